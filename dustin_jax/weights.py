"""Checkpoints -> params: Hugging Face safetensors, GGUF, orbax.

Every loader produces a flat dict of Hugging Face tensor names -> arrays and
goes through `params_from_hf_tensors`, which names each parameter of the
decoder, checks every name and shape before building anything, and
transposes linear weights to the decoder's `[in, out]` layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import struct
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

# CheckpointError lives in dustin_jax.config, light to import for the CLI
from dustin_jax.config import CheckpointError, ModelConfig, RopeConfig
from dustin_jax.gguf_file import read_gguf
from dustin_jax.models.decoder import Decoder
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
  is one compile (a program per parameter shape was ~25 compiles, seconds
  of every run's load time)."""
  graphdef, abstract = abstract_model(cfg)
  pure = nnx.to_pure_dict(abstract)
  paths = leaves_with_paths(pure)
  shardings = None
  if mesh is not None:
    by_path = dict(leaves_with_paths(nnx.to_pure_dict(param_shardings(abstract, mesh))))
    shardings = tuple(by_path[path] for path, _ in paths)
  kind = lambda path: "ones" if path[-1] == "weight" else "zeros" if path[-1] == "bias" else "uniform"
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


def params_from_hf_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray],
                           names: set[str], *, source: str = "checkpoint", mesh=None):
  """Build (graphdef, state) from Hugging Face-named tensors.

  `get_tensor(name)` returns an array-like with `.shape` (read lazily, so
  that name and shape checks of the whole checkpoint come before any copy).
  Under `mesh`, each parameter is assembled from the slices its local
  devices own (memory-mapped files: a host reads only its slices).
  """
  graphdef, abstract, plan = _check_hf_tensors(cfg, get_tensor, names, source)
  pure = nnx.to_pure_dict(abstract)
  leaves = leaves_with_paths(pure)
  shardings = {}
  if mesh is not None:
    shardings = dict(leaves_with_paths(nnx.to_pure_dict(param_shardings(abstract, mesh))))
  values = {}
  for path, name, transpose, dtype in plan:
    src = get_tensor(name)
    src = src.T if transpose else src
    if path in shardings:
      values[path] = jax.make_array_from_callback(
          tuple(src.shape), shardings[path], lambda idx, src=src, dt=dtype: np.asarray(src[idx]).astype(dt))
    else:
      values[path] = jnp.asarray(np.asarray(src), dtype=dtype)
  pure = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(pure), [values[p] for p, _ in leaves])
  nnx.replace_by_pure_dict(abstract, pure)
  return graphdef, abstract


def _check_hf_tensors(cfg: ModelConfig, get_tensor, names, source: str):
  """(graphdef, abstract state, [(path, name, transpose, dtype)]) once every
  parameter of `cfg` is found among `names` with its shape."""
  graphdef, abstract = abstract_model(cfg)
  plan = []
  for path, leaf in leaves_with_paths(nnx.to_pure_dict(abstract)):
    name, transpose = hf_name(path)
    expected = tuple(leaf.shape[::-1]) if transpose else tuple(leaf.shape)
    if name not in names:
      raise CheckpointError(f"{source}: missing tensor {name!r} (expected shape {expected}): "
                            "the checkpoint is incomplete or not of the model its config "
                            "describes")
    shape = tuple(get_tensor(name).shape)
    if shape != expected:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {shape}, expected {expected} "
                            "for this config: the weights and config.json are of different "
                            "models")
    plan.append((path, name, transpose, leaf.dtype))
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
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path,
                                           mesh=mesh)
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
    cfg, graphdef, state = restore_params(path)
    if kw.get("mesh") is not None:
      state = shard_params(state, kw["mesh"])
    return cfg, graphdef, state
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


def restore_params(path: str):
  """(ModelConfig, graphdef, state) from `save_params` output."""
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  cfg = saved_config(path)
  graphdef, abstract = abstract_model(cfg)
  target = nnx.to_pure_dict(abstract)
  pure = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), target)
  nnx.replace_by_pure_dict(abstract, pure)
  return cfg, graphdef, abstract


def hf_tensors_from_params(state) -> dict[str, np.ndarray]:
  """Inverse of `params_from_hf_tensors` (tests, export)."""
  out = {}
  for path, leaf in leaves_with_paths(nnx.to_pure_dict(state)):
    name, transpose = hf_name(path)
    arr = np.asarray(leaf)
    out[name] = arr.T if transpose else arr
  return out


# ------------------------------------------------------- placing on a mesh
def replicate_kv_heads(cfg: ModelConfig, state, r: int):
  """Repeat each KV head r times (k/v projection columns): query head h still
  reads a copy of KV head h // group_size. Returns (cfg, state)."""
  if r == 1:
    return cfg, state
  hd = cfg.head_dim
  pure = nnx.to_pure_dict(state)
  leaves = []
  for path, x in leaves_with_paths(pure):
    if tuple(map(str, path[-2:])) in {("k_proj", "kernel"), ("v_proj", "kernel"),
                                       ("k_proj", "bias"), ("v_proj", "bias")}:
      lead = x.shape[:-1]
      x = jnp.repeat(x.reshape(lead + (cfg.num_kv_heads, hd)), r, axis=-2)
      x = x.reshape(lead + (cfg.num_kv_heads * r * hd,))
    leaves.append(x)
  new_cfg = cfg.replace(num_kv_heads=cfg.num_kv_heads * r)
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
