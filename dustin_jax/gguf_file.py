"""Read GGUF checkpoints (llama.cpp's format) into Hugging Face names, without torch.

:func:`read_gguf` returns ``(config, tensors)``:

* ``config``: a dict shaped like a Hugging Face ``config.json`` of a
  ``LlamaConfig`` / ``Qwen2Config`` (``model_type`` "llama" or "qwen2"),
  built from the GGUF metadata;
* ``tensors``: ``{hf_name: np.ndarray}`` dequantised to float32, with Hugging
  Face names and shapes (``[out_features, in_features]`` for linear weights).

Two details of llama.cpp's converter are undone here:

* GGUF lists dimensions fastest-first (``ne[0]`` is the row length), i.e.
  reversed with respect to numpy/PyTorch; arrays come back in PyTorch order.
* For the **llama** architecture the converter permutes the rows of the Q and
  K projections within each head (from Hugging Face's "rotate half" RoPE
  layout to GPT-J-style interleaved pairs). Within a head of size ``D``,
  GGUF row ``2*j + s`` holds Hugging Face row ``s*D/2 + j``. We apply the
  inverse so the result equals the Hugging Face weights. qwen2 is not
  permuted by the converter, so nothing is done there.

Float metadata stored as float32 (``rms_norm_eps``, ``rope_theta``) is
reported as the shortest decimal that round-trips through float32 (e.g.
``1e-05`` rather than ``9.999999747378752e-06``), i.e. the value the original
``config.json`` most likely held.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from typing import Any, Callable, NamedTuple

import numpy as np

from dustin_jax.config import CheckpointError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "read_gguf",
    "read_gguf_config",
    "read_gguf_metadata",
    "gguf_to_hf_name",
    "unpermute_qk_rows",
]

#: GGUF ``general.architecture`` -> Hugging Face ``model_type``.
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
  """Hugging Face parameter name of a GGUF tensor name, or None if unknown."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _BLOCK_RE.match(name)
  if m is None or m.group(2) not in _BLOCK_NAMES:
    return None
  layer, part, kind = m.groups()
  return f"model.layers.{int(layer)}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's Q/K row permutation (along axis 0).

  llama.cpp's converter views the rows of each of ``n_head`` heads as
  ``(2, D/2)`` (the two rotary halves) and stores them transposed,
  ``(D/2, 2)``. This views GGUF rows as ``(n_head, D/2, 2)`` and swaps back.
  Works for weights ``[rows, in]`` and biases ``[rows]``.
  """
  rows = w.shape[0]
  if n_head <= 0 or rows % (2 * n_head):
    raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
  half = rows // n_head // 2
  rest = w.shape[1:]
  return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------
def _scalar(v: Any) -> Any:
  if isinstance(v, np.float32):
    # numpy prints the shortest decimal that round-trips through float32.
    return float(str(v))
  if isinstance(v, np.floating):
    return float(v)
  if isinstance(v, np.bool_):
    return bool(v)
  if isinstance(v, np.integer):
    return int(v)
  return v


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
  """The metadata of a GGUF file whose keys start with ``prefix``, as Python values.

  Strings are ``str`` (UTF-8), arrays are lists, numbers and booleans are
  Python scalars (float32 as its shortest round-tripping decimal). No tensor
  data is read.

  Raises:
    CheckpointError: the file cannot be read, or is truncated or corrupt.
  """
  reader = _open_reader(path)
  return {k: reader.get(k) for k in reader.keys if k.startswith(prefix)}


def _architecture(reader: "_Reader", path) -> str:
  arch = reader.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"unsupported GGUF architecture {arch!r} in {os.fspath(path)}; "
        f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )
  return arch


def _build_config(reader, path) -> dict:
  arch = _architecture(reader, path)
  p = arch + "."
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{os.fspath(path)}: no token_embd.weight tensor")

  hidden = reader.require(p + "embedding_length")
  n_heads = reader.require(p + "attention.head_count")
  n_kv = reader.get(p + "attention.head_count_kv", n_heads)
  if isinstance(n_kv, list):  # per-layer head counts: only uniform ones are supported
    if len(set(n_kv)) != 1:
      raise ValueError(f"{os.fspath(path)}: per-layer KV head counts {n_kv} are not supported")
    n_kv = n_kv[0]
  head_dim = reader.get(p + "attention.key_length", hidden // n_heads)
  # GGUF token_embd dims are [hidden, vocab] (fastest first): vocab is the last one.
  vocab = int(tensors["token_embd.weight"].shape[-1])

  cfg: dict[str, Any] = {
      "architectures": [_HF_ARCH_CLASS[arch]],
      "model_type": SUPPORTED_ARCHITECTURES[arch],
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": reader.require(p + "feed_forward_length"),
      "num_hidden_layers": reader.require(p + "block_count"),
      "num_attention_heads": n_heads,
      "num_key_value_heads": n_kv,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": reader.get(p + "context_length", 2048),
      "rms_norm_eps": reader.get(p + "attention.layer_norm_rms_epsilon", 1e-6),
      "rope_theta": reader.get(p + "rope.freq_base", 10000.0),
      "rope_scaling": None,
      "tie_word_embeddings": "output.weight" not in tensors,
  }
  if arch == "llama":
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    cfg["mlp_bias"] = False
  scaling = reader.get(p + "rope.scaling.type")
  if scaling not in (None, "none"):
    rs: dict[str, Any] = {"rope_type": scaling,
                          "factor": reader.get(p + "rope.scaling.factor", 1.0)}
    orig = reader.get(p + "rope.scaling.original_context_length")
    if orig is not None:
      rs["original_max_position_embeddings"] = orig
    attn = reader.get(p + "rope.scaling.attn_factor")
    if attn is not None:
      rs["attention_factor"] = attn
    cfg["rope_scaling"] = rs
  for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
    v = reader.get("tokenizer.ggml." + key)
    if v is not None:
      cfg[hf_key] = v
  return cfg


def read_gguf_config(path: str | os.PathLike) -> dict:
  """Only the Hugging Face-style config dict of a GGUF file (fast: no tensor data)."""
  return _build_config(_open_reader(path), path)


# ----------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------
_DAMAGED = "the file is truncated or corrupt: download or convert it again"
_GGUF_MAGIC = 0x46554747  # b"GGUF", little-endian
_STRING, _ARRAY = 8, 9
# GGUF metadata value types with a fixed size (GGUFValueType): struct formats
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
# GGML types stored as plain numbers: their numpy dtype (the rest are blocks of bytes)
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Tensor(NamedTuple):
  name: str
  tensor_type: Any           # gguf.GGMLQuantizationType
  shape: tuple[int, ...]     # GGUF order: fastest-varying dimension first
  data: np.ndarray           # a view of the file: numbers, or each row's bytes


class _Reader:
  """A GGUF file (llama.cpp's format, little-endian, versions 2 and 3),
  memory-mapped. The header is walked once; a metadata value is decoded
  when asked for, and tensors are views of the file. Why not
  `gguf.GGUFReader`: it builds numpy views of every field, ~300k strings for
  a 150k-token vocabulary, ~10 s per file on a small CPU; walking the header
  takes a fraction of a second."""

  def __init__(self, path: str):
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    with open(path, "rb") as f:
      self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    self._pos = 0
    magic, version = self._unpack("<II")
    if magic != _GGUF_MAGIC:
      raise ValueError("no GGUF magic at the start")
    if version not in (2, 3):
      raise ValueError(f"GGUF version {version}; versions 2 and 3 are supported")
    n_tensors, n_kv = self._unpack("<QQ")
    self._fields: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
      key = self._string()
      (vtype,) = self._unpack("<I")
      self._fields[key] = (vtype, self._pos)
      self._skip(vtype)
    infos = []
    for _ in range(n_tensors):
      name = self._string()
      (n_dims,) = self._unpack("<I")
      dims = self._unpack(f"<{n_dims}Q")
      infos.append((name, dims, *self._unpack("<IQ")))
    align = int(self.get("general.alignment", 32))
    start = -(-self._pos // align) * align
    size = len(self._buf)
    self.tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
      if name in names:
        raise ValueError(f"tensor {name!r} is listed twice")
      names.add(name)
      try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
      except (ValueError, KeyError):
        raise CheckpointError(f"{path}: tensor {name!r} has GGML type {raw_type}, unknown to "
                              "the installed gguf package: the file is corrupt, or needs a "
                              "newer gguf") from None
      n = int(np.prod(dims, dtype=object))
      begin, end = start + offset, start + offset + n * type_size // block
      if end > size:
        raise CheckpointError(f"{path}: tensor {name!r} needs bytes [{begin}, {end}) but the "
                              f"file has {size}: {_DAMAGED}")
      shape = tuple(reversed(dims))
      dtype = _PLAIN_DTYPES.get(qtype.name)
      if dtype is None:  # blocks of bytes: each row's bytes
        count, dtype = end - begin, np.uint8
        shape = shape[:-1] + (shape[-1] // block * type_size,)
      else:
        count = n
      data = np.frombuffer(self._buf, dtype, count, begin).reshape(shape)
      self.tensors.append(_Tensor(name, qtype, tuple(int(d) for d in dims), data))

  @property
  def keys(self):
    return self._fields.keys()

  def get(self, key: str, default: Any = None) -> Any:
    """The Python value of metadata `key` (arrays as lists), or `default`."""
    if key not in self._fields:
      return default
    vtype, self._pos = self._fields[key]
    return self._value(vtype)

  def require(self, key: str) -> Any:
    """`get(key)` of a key the file must have."""
    if key not in self._fields:
      raise ValueError(f"GGUF metadata key {key!r} is missing")
    return self.get(key)

  # -- the header walk
  def _unpack(self, fmt: str):
    out = struct.unpack_from(fmt, self._buf, self._pos)
    self._pos += struct.calcsize(fmt)
    return out

  def _string(self) -> str:
    (n,) = self._unpack("<Q")
    if self._pos + n > len(self._buf):
      raise ValueError("a string runs past the end of the file")
    self._pos += n
    return self._buf[self._pos - n:self._pos].decode("utf-8")

  def _skip(self, vtype: int) -> None:
    if vtype in _SCALAR:
      self._pos += struct.calcsize(_SCALAR[vtype])
    elif vtype == _STRING:
      (n,) = self._unpack("<Q")
      self._pos += n
    elif vtype == _ARRAY:
      sub, count = self._unpack("<IQ")
      if sub in _SCALAR:
        self._pos += count * struct.calcsize(_SCALAR[sub])
      else:
        for _ in range(count):
          self._skip(sub)
    else:
      raise ValueError(f"unknown metadata value type {vtype}")
    if self._pos > len(self._buf):
      raise ValueError("the metadata runs past the end of the file")

  def _value(self, vtype: int) -> Any:
    if vtype == _STRING:
      return self._string()
    if vtype == _ARRAY:
      sub, count = self._unpack("<IQ")
      if sub in _SCALAR and sub != 7:
        arr = np.frombuffer(self._buf, _SCALAR[sub], count, self._pos)
        self._pos += arr.nbytes
        return [_scalar(x) for x in arr] if sub == 6 else arr.tolist()
      return [self._value(sub) for _ in range(count)]
    if vtype not in _SCALAR:
      raise ValueError(f"unknown metadata value type {vtype}")
    (v,) = self._unpack(_SCALAR[vtype])
    return _scalar(np.float32(v)) if vtype == 6 else v


def _open_reader(path) -> _Reader:
  """The GGUF file at `path`, every tensor checked to lie inside the file
  (a truncated download otherwise fails later as an odd reshape error)."""
  name = os.fspath(path)
  try:
    return _Reader(name)
  except CheckpointError:
    raise
  except OSError as e:
    raise CheckpointError(f"{name}: cannot be read ({e.strerror or e})") from None
  except (ValueError, IndexError, OverflowError, struct.error, UnicodeDecodeError) as e:
    raise CheckpointError(f"{name}: not a readable GGUF file ({e}): {_DAMAGED}") from None


def _dequantize(t) -> np.ndarray:
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize

  shape = tuple(reversed(t.shape))
  if t.tensor_type == GGMLQuantizationType.F32:
    arr = np.array(t.data, dtype=np.float32, copy=True)  # own the memory (not the mmap)
  else:
    try:
      arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise CheckpointError(
          f"tensor {t.name}: GGML type {t.tensor_type.name} cannot be dequantised: {e}"
      ) from None
    arr = np.asarray(arr, dtype=np.float32)
  return arr.reshape(shape)


def _check_complete(cfg: dict, out: dict[str, np.ndarray], path) -> None:
  h, d = cfg["hidden_size"], cfg["head_dim"]
  expected = {
      "model.embed_tokens.weight": (cfg["vocab_size"], h),
      "model.norm.weight": (h,),
  }
  if not cfg["tie_word_embeddings"]:
    expected["lm_head.weight"] = (cfg["vocab_size"], h)
  for i in range(cfg["num_hidden_layers"]):
    pre = f"model.layers.{i}."
    expected.update({
        pre + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * d, h),
        pre + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * d, h),
        pre + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * d, h),
        pre + "self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * d),
        pre + "mlp.gate_proj.weight": (cfg["intermediate_size"], h),
        pre + "mlp.up_proj.weight": (cfg["intermediate_size"], h),
        pre + "mlp.down_proj.weight": (h, cfg["intermediate_size"]),
        pre + "input_layernorm.weight": (h,),
        pre + "post_attention_layernorm.weight": (h,),
    })
    if cfg["model_type"] == "qwen2":
      for proj, n in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"]),
                      ("v", cfg["num_key_value_heads"])):
        expected[pre + f"self_attn.{proj}_proj.bias"] = (n * d,)
  missing = sorted(k for k in expected if k not in out)
  if missing:
    raise CheckpointError(f"{os.fspath(path)}: missing tensors {missing[:5]}"
                          + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
  bad = [(k, out[k].shape, s) for k, s in expected.items() if out[k].shape != s]
  if bad:
    raise CheckpointError(f"{os.fspath(path)}: unexpected tensor shapes (name, got, expected): "
                          f"{bad[:5]}")


def read_gguf(
    path: str | os.PathLike,
    *,
    progress: bool = True,
    tensor_filter: Callable[[str], bool] | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
  """Read a llama/qwen2 GGUF file: ``(hf_config_dict, {hf_name: float32 array})``.

  Args:
    path: the ``.gguf`` file.
    progress: show a tqdm bar over the tensors.
    tensor_filter: optional predicate on the Hugging Face name; tensors for
      which it returns False are not dequantised (and the completeness check
      is skipped).

  Raises:
    ValueError: unsupported architecture (named in the message); a
      CheckpointError (a ValueError) for a truncated or corrupt file, an
      unknown tensor, an unsupported quantisation type, or missing /
      mis-shaped tensors.
  """
  from tqdm.auto import tqdm

  reader = _open_reader(path)
  cfg = _build_config(reader, path)
  permute = cfg["model_type"] == "llama"
  heads = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}

  out: dict[str, np.ndarray] = {}
  for t in tqdm(reader.tensors, desc=f"reading {os.path.basename(os.fspath(path))}",
                unit="tensor", disable=not progress, leave=False):
    hf = gguf_to_hf_name(t.name)
    if hf is None:
      if t.name == "rope_freqs.weight":
        raise CheckpointError(
            f"{os.fspath(path)}: tensor rope_freqs.weight (llama-3-style RoPE "
            "frequency scaling) is not supported"
        )
      raise CheckpointError(f"{os.fspath(path)}: unknown GGUF tensor {t.name!r}")
    if tensor_filter is not None and not tensor_filter(hf):
      continue
    arr = _dequantize(t)
    if permute:
      m = re.search(r"\.self_attn\.([qk])_proj\.", hf)
      if m:
        arr = unpermute_qk_rows(arr, heads[m.group(1)])
    out[hf] = arr
  if tensor_filter is None:
    _check_complete(cfg, out, path)
  return cfg, out
