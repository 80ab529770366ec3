"""Checkpoints -> params: Hugging Face safetensors, GGUF, orbax.

Every loader produces a flat dict of Hugging Face tensor names -> arrays and
goes through `params_from_hf_tensors`, which names each parameter of the
decoder, checks every name and shape before building anything, and
transposes linear weights to the decoder's `[in, out]` layout.
"""

from __future__ import annotations

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

from dustin_jax.config import ModelConfig
from dustin_jax.models.decoder import Decoder


class CheckpointError(ValueError):
  """A checkpoint that does not match the model it is loaded into."""


# ----------------------------------------------------------- model creation
def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract state) of the decoder, without allocating."""
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def random_params(cfg: ModelConfig, seed: int = 0, shardings=None):
  """(graphdef, state) with random weights, initialised inside jit so that
  paper-scale shapes never pass through the host."""
  graphdef, _ = abstract_model(cfg)
  def init():
    return nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed)))
  state = jax.jit(init, out_shardings=shardings)()
  return graphdef, state


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


def _leaves_with_paths(tree) -> list[tuple[tuple, object]]:
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out.append((tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), leaf))
  return out


def params_from_hf_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray],
                           names: set[str], *, source: str = "checkpoint"):
  """Build (graphdef, state) from Hugging Face-named tensors.

  `get_tensor(name)` returns an array-like with `.shape` (read lazily, so
  that name and shape checks of the whole checkpoint come before any copy).
  """
  graphdef, abstract = abstract_model(cfg)
  pure = nnx.to_pure_dict(abstract)
  leaves = _leaves_with_paths(pure)
  plan = []
  for path, leaf in leaves:
    name, transpose = hf_name(path)
    expected = tuple(leaf.shape[::-1]) if transpose else tuple(leaf.shape)
    if name not in names:
      raise CheckpointError(f"{source}: missing tensor {name!r} "
                            f"(expected shape {expected})")
    shape = tuple(get_tensor(name).shape)
    if shape != expected:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {shape}, "
                            f"expected {expected} for this config")
    plan.append((path, name, transpose, leaf.dtype))
  values = {}
  for path, name, transpose, dtype in plan:
    arr = np.asarray(get_tensor(name))
    if transpose:
      arr = arr.T
    values[path] = jnp.asarray(arr, dtype=dtype)
  pure = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(pure), [values[p] for p, _ in leaves])
  nnx.replace_by_pure_dict(abstract, pure)
  return graphdef, abstract


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
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
  out = {}
  for name, info in header.items():
    dtype = _ST_DTYPES.get(info["dtype"])
    if dtype is None:
      raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    out[name] = mm[start:end].view(dtype).reshape(info["shape"])
  return out


def load_hf_checkpoint(path: str, *, dtype: str = "bfloat16", num_layers=None):
  """(ModelConfig, graphdef, state) from a Hugging Face checkpoint directory
  (config.json + one or several *.safetensors, with or without an index)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint directory {path!r} does not exist")
  cfg = ModelConfig.from_hf(path, dtype=dtype, num_layers=num_layers)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files")
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(safetensors_index(f))
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path)
  return cfg, graphdef, state


def load_gguf_checkpoint(path: str, *, dtype: str = "float32", num_layers=None):
  """(ModelConfig, graphdef, state) from a GGUF file (dequantised)."""
  from dustin_jax.gguf_file import read_gguf
  hf_config, tensors = read_gguf(path)
  cfg = ModelConfig.from_hf(hf_config, dtype=dtype, num_layers=num_layers)
  graphdef, state = params_from_hf_tensors(cfg, tensors.__getitem__, set(tensors), source=path)
  return cfg, graphdef, state


def load_checkpoint(path: str, **kw):
  """A GGUF file, an orbax directory written by `save_params`, or a
  Hugging Face directory."""
  if os.path.isfile(path) and path.endswith(".gguf"):
    return load_gguf_checkpoint(path, **kw)
  if os.path.isfile(os.path.join(path, "dustin_config.json")):
    return restore_params(path)
  return load_hf_checkpoint(path, **kw)


# ------------------------------------------------------------------ orbax
def save_params(path: str, cfg: ModelConfig, state) -> None:
  """Converted params -> an orbax checkpoint (plus our config as JSON)."""
  import dataclasses
  import orbax.checkpoint as ocp
  path = os.path.abspath(path)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(path, "params"), nnx.to_pure_dict(state))
  ckpt.wait_until_finished()
  with open(os.path.join(path, "dustin_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=1)


def restore_params(path: str):
  """(ModelConfig, graphdef, state) from `save_params` output."""
  import orbax.checkpoint as ocp
  from dustin_jax.config import RopeConfig
  path = os.path.abspath(path)
  with open(os.path.join(path, "dustin_config.json")) as f:
    d = json.load(f)
  d["rope"] = RopeConfig(**d["rope"])
  d["eos_token_ids"] = tuple(d["eos_token_ids"])
  cfg = ModelConfig(**d)
  graphdef, abstract = abstract_model(cfg)
  target = nnx.to_pure_dict(abstract)
  pure = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), target)
  nnx.replace_by_pure_dict(abstract, pure)
  return cfg, graphdef, abstract


def hf_tensors_from_params(state) -> dict[str, np.ndarray]:
  """Inverse of `params_from_hf_tensors` (tests, export)."""
  out = {}
  for path, leaf in _leaves_with_paths(nnx.to_pure_dict(state)):
    name, transpose = hf_name(path)
    arr = np.asarray(leaf)
    out[name] = arr.T if transpose else arr
  return out


def check_vocab(draft: ModelConfig, target: ModelConfig, tokenizer_vocab: int | None = None):
  """Draft and target may differ in padded vocab size (extra ids never
  produced by the tokenizer); anything the tokenizer can emit must exist in
  both."""
  if tokenizer_vocab is not None:
    for name, c in (("draft", draft), ("target", target)):
      if c.vocab_size < tokenizer_vocab:
        raise CheckpointError(f"{name} vocab_size={c.vocab_size} is smaller than the "
                              f"tokenizer's {tokenizer_vocab} ids")

