"""Checkpoints -> params: Hugging Face safetensors, GGUF, orbax.

Every loader produces a flat dict of Hugging Face tensor names -> arrays and
goes through `params_from_hf_tensors`, which names each parameter of the
decoder, checks every name and shape before building anything, and
transposes linear weights to the decoder's `[in, out]` layout. The fused
projections (`qkv_proj`, `gate_up_proj`: models/decoder.py) are assembled
there from their Hugging Face tensors (q/k/v, gate/up) and split back by
`hf_tensors_from_params`; checkpoints never hold them fused.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import json
import os
import struct
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

# CheckpointError lives in dustin_jax.config, light to import for the CLI
from dustin_jax.config import CheckpointError, ModelConfig, RopeConfig
from dustin_jax.gguf_file import read_gguf
from dustin_jax.models.decoder import Decoder, gate_up_columns, qkv_columns
from dustin_jax.sharding import kv_replication, leaves_with_paths, param_shardings, shard_params


# ----------------------------------------------------------- model creation
def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract state) of the decoder, without allocating."""
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def random_params(cfg: ModelConfig, seed: int = 0, mesh=None):
  """(graphdef, state) with random weights of the real shapes (benchmarks).

  One jitted program fills every parameter directly in its shards: a
  counter-based hash of the element index gives uniform values of std 0.02
  (norm scales 1, biases 0). Unlike a threefry normal over a whole
  embedding table, this needs no temporaries, so paper-scale shapes never
  pass through one device or the host; and one program for the whole model
  is one compile (a program per parameter shape would be ~25 compiles, seconds
  of every run's load time)."""
  graphdef, abstract = abstract_model(cfg)
  pure = nnx.to_pure_dict(abstract)
  paths = leaves_with_paths(pure)
  shardings = None
  if mesh is not None:
    by_path = dict(leaves_with_paths(nnx.to_pure_dict(param_shardings(abstract, mesh))))
    shardings = tuple(by_path[path] for path, _ in paths)
  kind = lambda path: ("ones" if path[-1] == "weight" else "zeros" if path[-1] == "bias"
                       else "uniform")
  specs = tuple((tuple(leaf.shape), jnp.dtype(leaf.dtype), kind(path)) for path, leaf in paths)
  leaves = _filler(specs, shardings)(jnp.uint32(seed))
  pure = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pure), leaves)
  nnx.replace_by_pure_dict(abstract, pure)
  return graphdef, abstract


@functools.lru_cache(maxsize=None)
def _filler(specs, shardings):
  # the seed traced: one program per model shape and placement
  def fill(seed):
    base = seed * jnp.uint32(1000003)
    return [random_fill(shape, dtype, kind, base + jnp.uint32(i))
            for i, (shape, dtype, kind) in enumerate(specs)]
  return jax.jit(fill, out_shardings=None if shardings is None else list(shardings))


def random_fill(shape, dtype, kind, salt):
  """An array of `shape`: ones or zeros (`kind` "ones" / "zeros"), or
  ("uniform") values of mean 0 and std 0.02 from a counter-based hash of
  each element's index and the uint32 `salt`: no temporaries beyond the
  output, so it can be made directly in its shards under jit."""
  if kind != "uniform":
    return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for ax in reversed(range(len(shape))):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride & 0xFFFFFFFF)
    stride *= shape[ax]
  h = idx ^ salt
  for mul, shift in ((0x9E3779B1, 16), (0x85EBCA77, 13), (0xC2B2AE3D, 16)):
    h = (h * jnp.uint32(mul)) ^ (h >> shift)
  u = h.astype(jnp.float32) * (1.0 / 2**32)  # [0, 1)
  return ((u - 0.5) * (0.02 * 12 ** 0.5)).astype(dtype)


# ---------------------------------------------------- HF names <-> our paths
def hf_name(path: tuple) -> tuple[str, bool]:
  """Our pure-dict path -> (Hugging Face tensor name, transpose?)."""
  parts = [str(p) for p in path]
  transpose = parts[-1] == "kernel"
  if transpose:
    parts[-1] = "weight"
  if parts == ["embed_tokens"]:
    parts = ["embed_tokens", "weight"]
  name = ".".join(parts)
  return (name if parts[0] == "lm_head" else "model." + name), transpose


# fused parameter -> the Hugging Face projections it holds, in `[a | b ...]` order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_layout(cfg: ModelConfig, fused: str):
  """(column widths of the parts, the fused column order) of a fused projection."""
  if fused == "qkv_proj":
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return (q, kv, kv), qkv_columns(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
  f = cfg.intermediate_size
  return (f, f), gate_up_columns(f)


def hf_sources(cfg: ModelConfig, path: tuple, shape: tuple):
  """The Hugging Face tensors of the parameter at `path` (of `shape`):
  ([(name, transpose, expected HF shape)], column order or None). With an
  order, the parameter is the parts (transposed as said) side by side on
  their last axis, its columns taken in that order (a fused projection)."""
  path = tuple(str(p) for p in path)
  if len(path) < 2 or path[-2] not in _FUSED:
    name, transpose = hf_name(path)
    return [(name, transpose, tuple(shape[::-1]) if transpose else tuple(shape))], None
  widths, order = _fused_layout(cfg, path[-2])
  parts = []
  for part, width in zip(_FUSED[path[-2]], widths):
    name, transpose = hf_name(path[:-2] + (part, path[-1]))
    ours = tuple(shape[:-1]) + (width,)
    parts.append((name, transpose, ours[::-1] if transpose else ours))
  return parts, order


class _Fused:
  """A fused parameter, lazily: the Hugging Face `parts` (as stored: kernels
  `[out, in]`, biases `[out]`) stacked on their first axis, its entries in
  `order`, then transposed (ours: `[in, n]` / `[n]`). Sliced like an array,
  it reads only the rows of the parts the slice needs (a host assembles only
  the shards its devices own), and copies whole rows: stacking on the
  stored layout's contiguous axis is a row copy, while gathering columns of
  the transposed views is ~5x slower (a 7B gate/up: 1.1 s a layer)."""

  def __init__(self, parts, order):
    widths = [p.shape[0] for p in parts]
    self.parts = parts
    self.part = np.repeat(np.arange(len(parts)), widths)[order]
    self.row = np.concatenate([np.arange(w) for w in widths])[order]
    self.shape = tuple(parts[0].shape[1:])[::-1] + (len(order),)
    self.dtype = np.result_type(*(p.dtype for p in parts))

  def __getitem__(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = (idx + (slice(None),) * (len(self.shape) - len(idx)))[::-1]  # the stored order
    part, row, rest = self.part[idx[0]], self.row[idx[0]], idx[1:]
    cols = np.empty(self.parts[0].shape[1:], np.bool_)[rest].shape
    out = np.empty((len(part),) + cols, self.dtype)
    for i, src in enumerate(self.parts):
      pos = np.flatnonzero(part == i)
      for dst, rows in _runs(pos, row[pos]):
        out[dst] = src[(rows,) + rest]
    return out.T

  def __array__(self, dtype=None, copy=None):
    out = self[()]
    return out if dtype is None else out.astype(dtype)


def _runs(dst: np.ndarray, src: np.ndarray, most: int = 64):
  """Copy row src[i] to dst[i] for every i as [(dst index, src index)]:
  one pair of strided slices when both are evenly spaced (gate/up
  interleaved), else a slice pair per contiguous run (a q/k/v head group),
  else (`most` runs or more) the index arrays. Why: numpy copies strided
  slices several times faster than it gathers or scatters by index arrays."""
  if len(dst) == 0:
    return []
  def spaced(x):
    step = int(x[1] - x[0]) if len(x) > 1 else 1
    return step > 0 and bool(np.all(np.diff(x) == step)), step
  (even_d, sd), (even_s, ss) = spaced(dst), spaced(src)
  if even_d and even_s:
    return [(slice(dst[0], dst[-1] + 1, sd), slice(src[0], src[-1] + 1, ss))]
  starts = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
  if len(starts) >= most:
    return [(dst, src)]
  return [(slice(d[0], d[-1] + 1), slice(s[0], s[-1] + 1))
          for d, s in zip(np.split(dst, starts), np.split(src, starts))]


def params_from_hf_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray],
                           names: set[str], *, source: str = "checkpoint", mesh=None,
                           release: Callable[[str], Any] | None = None):
  """Build (graphdef, state) from Hugging Face-named tensors.

  `get_tensor(name)` returns an array-like with `.shape` (read lazily, so
  that name and shape checks of the whole checkpoint come before any copy).
  Under `mesh`, each parameter is assembled from the slices its local
  devices own (memory-mapped files: a host reads only its slices).
  `release(name)` is called once a tensor's last parameter is built, so a
  caller holding host copies (dequantised GGUF) can drop each one early.
  """
  graphdef, abstract, plan = _check_hf_tensors(cfg, get_tensor, names, source)
  uses = collections.Counter(name for _, parts, _, _ in plan for name, _, _ in parts)
  pure = nnx.to_pure_dict(abstract)
  leaves = leaves_with_paths(pure)
  shardings = {}
  if mesh is not None:
    shardings = dict(leaves_with_paths(nnx.to_pure_dict(param_shardings(abstract, mesh))))
  values = {}
  for path, parts, order, dtype in plan:
    if order is None:
      (name, transpose, _), = parts
      src = get_tensor(name).T if transpose else get_tensor(name)
    else:  # kernels transposed, biases 1-D: ours is the stored stack's .T either way
      src = _Fused([get_tensor(name) for name, _, _ in parts], order)
    if path in shardings:
      values[path] = jax.make_array_from_callback(
          tuple(src.shape), shardings[path], lambda idx, src=src, dt=dtype: np.asarray(src[idx]).astype(dt))
    else:
      values[path] = jnp.asarray(np.asarray(src), dtype=dtype)
    for name, _, _ in parts:
      uses[name] -= 1
      if release is not None and not uses[name]:
        release(name)
  pure = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(pure), [values[p] for p, _ in leaves])
  nnx.replace_by_pure_dict(abstract, pure)
  return graphdef, abstract


def _check_hf_tensors(cfg: ModelConfig, get_tensor, names, source: str):
  """(graphdef, abstract state, [(path, parts, order, dtype)] as `hf_sources`
  gives them) once every tensor of `cfg` is found among `names` with its shape."""
  graphdef, abstract = abstract_model(cfg)
  plan = []
  for path, leaf in leaves_with_paths(nnx.to_pure_dict(abstract)):
    parts, order = hf_sources(cfg, path, leaf.shape)
    for name, _, expected in parts:
      if name not in names:
        raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {expected}): "
                              "the checkpoint is incomplete or not of the model its config "
                              "describes")
      shape = tuple(get_tensor(name).shape)
      if shape != expected:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {shape}, expected {expected} "
                              "for this config: the weights and config.json are of different "
                              "models")
    plan.append((path, parts, order, leaf.dtype))
  return graphdef, abstract, plan


# ------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def safetensors_index(path: str) -> dict[str, np.ndarray]:
  """Memory-mapped views of every tensor of one .safetensors file.

  Reading the format directly (an 8-byte header size, a JSON header, raw
  data) gives lazy, sliceable bf16 arrays without torch; a host that loads
  a shard of a parameter touches only the bytes of its slice."""
  def corrupt(why):
    return CheckpointError(f"{path}: not a valid safetensors file ({why}): it is truncated or "
                           "corrupt; download or save it again")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
      raise corrupt(f"a header of {n} bytes in a file of {size}")
    try:
      header = json.loads(f.read(n))
    except ValueError:  # not UTF-8 or not JSON
      raise corrupt("the header is not JSON") from None
  if not isinstance(header, dict):
    raise corrupt("the header is not a JSON object")
  header.pop("__metadata__", None)
  data = size - 8 - n
  mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if data else np.zeros(0, np.uint8)
  out = {}
  for name, info in header.items():
    try:
      kind, shape = info["dtype"], tuple(int(d) for d in info["shape"])
      start, end = (int(x) for x in info["data_offsets"])
    except (TypeError, KeyError, ValueError):
      raise corrupt(f"tensor {name!r} has a malformed header entry") from None
    dtype = _ST_DTYPES.get(kind)
    if dtype is None:
      raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {kind}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not 0 <= start <= end <= data or end - start != nbytes:
      raise corrupt(f"tensor {name!r} of shape {shape} needs bytes [{start}, {start + nbytes}) "
                    f"of {data} data bytes")
    out[name] = mm[start:end].view(dtype).reshape(shape)
  return out


def load_hf_checkpoint(path: str, *, dtype: str = "bfloat16", num_layers=None, mesh=None):
  """(ModelConfig, graphdef, state) from a Hugging Face checkpoint directory
  (config.json + one or several *.safetensors, with or without an index)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint directory {path!r} does not exist")
  cfg = ModelConfig.from_hf(path, dtype=dtype, num_layers=num_layers)
  tensors = hf_checkpoint_tensors(path)
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path,
                                           mesh=mesh)
  return cfg, graphdef, state


def hf_checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  """Memory-mapped views of every tensor of a Hugging Face checkpoint
  directory (headers read and checked; no tensor data touched)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint directory {path!r} does not exist")
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files: a Hugging Face checkpoint directory "
                          "holds config.json and model*.safetensors")
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(safetensors_index(f))
  return tensors


def check_hf_checkpoint(path: str, cfg: ModelConfig) -> None:
  """Every tensor `cfg` needs is in the checkpoint directory, of its shape
  and inside its file: the whole check before any weight is read."""
  tensors = hf_checkpoint_tensors(path)
  _check_hf_tensors(cfg, tensors.__getitem__, set(tensors), path)


@contextlib.contextmanager
def gguf_errors(path: str):
  """A GGUF file that the reader refuses (bad metadata, unknown tensors) as
  one CheckpointError naming the file."""
  try:
    yield
  except CheckpointError:
    raise
  except ValueError as e:
    msg = str(e)
    raise CheckpointError(msg if os.fspath(path) in msg else f"{path}: {msg}") from None


def load_gguf_checkpoint(path: str, *, dtype: str = "float32", num_layers=None, mesh=None):
  """(ModelConfig, graphdef, state) from a GGUF file (dequantised)."""
  with gguf_errors(path):
    hf_config, tensors = read_gguf(path)
  cfg = ModelConfig.from_hf(hf_config, dtype=dtype, num_layers=num_layers)
  # each dequantised host array is dropped once copied: the peak stays near
  # one model instead of two (~13 GB for a 1.5B model in f32)
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path,
                                           mesh=mesh, release=tensors.pop)
  return cfg, graphdef, state


def load_checkpoint(path: str, **kw):
  """A GGUF file, an orbax directory written by `save_params`, or a
  Hugging Face directory."""
  if os.path.isfile(path) and path.endswith(".gguf"):
    return load_gguf_checkpoint(path, **kw)
  if os.path.isfile(path):
    raise CheckpointError(f"checkpoint {path!r} is a file but not a .gguf: give a .gguf file or "
                          "a checkpoint directory")
  if os.path.isfile(os.path.join(path, "dustin_config.json")):
    return restore_params(path, mesh=kw.get("mesh"))
  return load_hf_checkpoint(path, **kw)


# ------------------------------------------------------------------ orbax
def save_params(path: str, cfg: ModelConfig, state) -> None:
  """Converted params -> an orbax checkpoint (plus our config as JSON)."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(path, "params"), nnx.to_pure_dict(state))
  ckpt.wait_until_finished()
  with open(os.path.join(path, "dustin_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)


def saved_config(path: str) -> ModelConfig:
  """The ModelConfig that `save_params` wrote beside the params."""
  name = os.path.join(path, "dustin_config.json")
  try:
    with open(name, encoding="utf-8") as f:
      d = json.load(f)
    d["rope"] = RopeConfig(**d["rope"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    return ModelConfig(**d)
  except (ValueError, TypeError, KeyError) as e:
    raise CheckpointError(f"{name} is not a config written by save_params ({e!r}): save the "
                          "checkpoint again") from None


def restore_params(path: str, mesh=None):
  """(ModelConfig, graphdef, state) from `save_params` output.

  The saved arrays are read to the host as they were stored and go through
  `params_from_hf_tensors` by their Hugging Face names, like any checkpoint:
  the same checks and messages, and a checkpoint saved before a layout change
  (e.g. q/k/v saved as separate projections) loads into the current one."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  cfg = saved_config(path)
  where = os.path.join(path, "params")
  ckpt = ocp.PyTreeCheckpointer()
  meta = ckpt.metadata(where)
  meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
  args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  pure = ckpt.restore(where, args=ocp.args.PyTreeRestore(restore_args=args))
  tensors = _hf_tensors(cfg, pure)
  del pure  # the restored host arrays live on in `tensors` only: each is dropped once copied
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path,
                                           mesh=mesh, release=tensors.pop)
  return cfg, graphdef, state


def hf_tensors_from_params(cfg: ModelConfig, state) -> dict[str, np.ndarray]:
  """Inverse of `params_from_hf_tensors` (tests, export): the fused
  projections split back into their Hugging Face tensors."""
  return _hf_tensors(cfg, nnx.to_pure_dict(state))


def _hf_tensors(cfg: ModelConfig, pure) -> dict[str, np.ndarray]:
  """{Hugging Face name: array} of a pure dict of params (fused or not)."""
  out = {}
  for path, leaf in leaves_with_paths(pure):
    arr = np.asarray(leaf)
    parts, order = hf_sources(cfg, path, arr.shape)
    if order is not None:  # back to [a | b ...] column order, then split
      arr = arr[..., np.argsort(order)]
      widths, _ = _fused_layout(cfg, str(path[-2]))
      arr = np.split(arr, np.cumsum(widths)[:-1], axis=-1)
    else:
      arr = [arr]
    for (name, transpose, _), x in zip(parts, arr):
      out[name] = x.T if transpose else x
  return out


# ------------------------------------------------------- placing on a mesh
def replicate_kv_heads(cfg: ModelConfig, state, r: int):
  """Repeat each KV head r times: query head h still reads a copy of KV head
  h // group_size. In `qkv_proj` (`qkv_columns`) each group [its r0 query
  heads, k, v] becomes r groups of r0 / r query heads, each with a copy of
  k and v. Returns (cfg, state)."""
  if r == 1:
    return cfg, state
  hd, g = cfg.head_dim, cfg.num_kv_heads
  r0 = cfg.num_heads // g
  if r0 % r:
    raise ValueError(f"{r} copies of each KV head: the {r0} query heads of a group do not "
                     "split evenly")
  pure = nnx.to_pure_dict(state)
  leaves = []
  for path, x in leaves_with_paths(pure):
    if len(path) > 1 and str(path[-2]) == "qkv_proj":
      lead = x.shape[:-1]
      x = x.reshape(lead + (g, r0 + 2, hd))
      q = x[..., :r0, :].reshape(lead + (g, r, r0 // r, hd))
      kv = jnp.broadcast_to(x[..., None, r0:, :], lead + (g, r, 2, hd))
      x = jnp.concatenate([q, kv], axis=-2).reshape(lead + (-1,))
    leaves.append(x)
  new_cfg = cfg.replace(num_kv_heads=g * r)
  _, abstract = abstract_model(new_cfg)
  pure = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pure), leaves)
  nnx.replace_by_pure_dict(abstract, pure)
  return new_cfg, abstract


def place_model(cfg: ModelConfig, graphdef, state, mesh):
  """(cfg, graphdef, state) ready for `mesh`: KV heads replicated where the
  model axis needs whole heads on every device (`sharding.kv_replication`),
  params sharded."""
  r = kv_replication(cfg, mesh.shape["model"])
  if r > 1:
    cfg, state = replicate_kv_heads(cfg, state, r)
    graphdef = abstract_model(cfg)[0]
  return cfg, graphdef, shard_params(state, mesh)
