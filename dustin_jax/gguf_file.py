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

import os
import re
from typing import Any, Callable

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


def _field_value(field) -> Any:
  """Python value of a scalar or string GGUF metadata field (arrays -> list)."""
  from gguf import GGUFValueType

  main = field.types[0]
  if main == GGUFValueType.STRING:
    return bytes(field.parts[field.data[0]]).decode("utf-8")
  if main == GGUFValueType.ARRAY:
    sub = field.types[-1]
    if sub == GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [_scalar(field.parts[i][0]) for i in field.data]
  if main == GGUFValueType.BOOL:
    return bool(field.parts[field.data[0]][0])
  return _scalar(field.parts[field.data[0]][0])


class _Meta:
  def __init__(self, reader):
    self._fields = reader.fields

  def get(self, key: str, default: Any = None) -> Any:
    f = self._fields.get(key)
    return default if f is None else _field_value(f)

  def require(self, key: str) -> Any:
    f = self._fields.get(key)
    if f is None:
      raise ValueError(f"GGUF metadata key {key!r} is missing")
    return _field_value(f)


def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
  """The metadata of a GGUF file whose keys start with ``prefix``, as Python values.

  Strings are ``str`` (UTF-8), arrays are lists, numbers and booleans are
  Python scalars (float32 as its shortest round-tripping decimal). No tensor
  data is read.

  Raises:
    CheckpointError: the file cannot be read, or is truncated or corrupt.
  """
  reader = _open_reader(path)
  return {k: _field_value(f) for k, f in reader.fields.items() if k.startswith(prefix)}


def _architecture(meta: _Meta, path) -> str:
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"unsupported GGUF architecture {arch!r} in {os.fspath(path)}; "
        f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )
  return arch


def _build_config(reader, path) -> dict:
  meta = _Meta(reader)
  arch = _architecture(meta, path)
  p = arch + "."
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise ValueError(f"{os.fspath(path)}: no token_embd.weight tensor")

  hidden = meta.require(p + "embedding_length")
  n_heads = meta.require(p + "attention.head_count")
  n_kv = meta.get(p + "attention.head_count_kv", n_heads)
  if isinstance(n_kv, list):  # per-layer head counts: only uniform ones are supported
    if len(set(n_kv)) != 1:
      raise ValueError(f"{os.fspath(path)}: per-layer KV head counts {n_kv} are not supported")
    n_kv = n_kv[0]
  head_dim = meta.get(p + "attention.key_length", hidden // n_heads)
  # GGUF token_embd dims are [hidden, vocab] (fastest first): vocab is the last one.
  vocab = int(tensors["token_embd.weight"].shape[-1])

  cfg: dict[str, Any] = {
      "architectures": [_HF_ARCH_CLASS[arch]],
      "model_type": SUPPORTED_ARCHITECTURES[arch],
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": meta.require(p + "feed_forward_length"),
      "num_hidden_layers": meta.require(p + "block_count"),
      "num_attention_heads": n_heads,
      "num_key_value_heads": n_kv,
      "head_dim": head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": meta.get(p + "context_length", 2048),
      "rms_norm_eps": meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6),
      "rope_theta": meta.get(p + "rope.freq_base", 10000.0),
      "rope_scaling": None,
      "tie_word_embeddings": "output.weight" not in tensors,
  }
  if arch == "llama":
    cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    cfg["mlp_bias"] = False
  scaling = meta.get(p + "rope.scaling.type")
  if scaling not in (None, "none"):
    rs: dict[str, Any] = {"rope_type": scaling, "factor": meta.get(p + "rope.scaling.factor", 1.0)}
    orig = meta.get(p + "rope.scaling.original_context_length")
    if orig is not None:
      rs["original_max_position_embeddings"] = orig
    attn = meta.get(p + "rope.scaling.attn_factor")
    if attn is not None:
      rs["attention_factor"] = attn
    cfg["rope_scaling"] = rs
  for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
    v = meta.get("tokenizer.ggml." + key)
    if v is not None:
      cfg[hf_key] = v
  return cfg


def read_gguf_config(path: str | os.PathLike) -> dict:
  """Only the Hugging Face-style config dict of a GGUF file (fast: no tensor data)."""
  return _build_config(_open_reader(path), path)


# ----------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------
def _open_reader(path):
  """A GGUFReader of `path`, every tensor checked to lie inside the file
  (a truncated download otherwise fails later as an odd reshape error)."""
  from gguf import GGMLQuantizationType, GGUFReader
  from gguf.constants import GGML_QUANT_SIZES

  name = os.fspath(path)
  damaged = "the file is truncated or corrupt: download or convert it again"

  class Reader(GGUFReader):
    def _build_tensors(self, start_offs, fields):
      size = len(self.data)
      for field in fields:
        if len(field.parts) != 6:  # a tensor-info layout of another gguf version: unchecked
          break
        _, raw_name, _, dims, raw_type, offset = field.parts
        tensor = bytes(raw_name).decode("utf-8", "replace")
        try:
          block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
        except (ValueError, KeyError):
          raise CheckpointError(f"{name}: tensor {tensor!r} has GGML type {int(raw_type[0])}, "
                                "unknown to the installed gguf package: the file is corrupt, "
                                "or needs a newer gguf") from None
        start = int(start_offs) + int(offset[0])
        end = start + int(np.prod(dims.astype(object))) * type_size // block
        if end > size:
          raise CheckpointError(f"{name}: tensor {tensor!r} needs bytes [{start}, {end}) but "
                                f"the file has {size}: {damaged}")
      super()._build_tensors(start_offs, fields)

  try:
    return Reader(name)
  except CheckpointError:
    raise
  except OSError as e:
    raise CheckpointError(f"{name}: cannot be read ({e.strerror or e})") from None
  except (ValueError, IndexError, OverflowError) as e:  # the header itself is cut or garbled
    raise CheckpointError(f"{name}: not a readable GGUF file ({e}): {damaged}") from None


def _dequantize(t) -> np.ndarray:
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize

  shape = tuple(int(d) for d in reversed(t.shape.tolist()))
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
