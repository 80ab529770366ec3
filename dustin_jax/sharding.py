"""Sharding: one table from logical axes to mesh axes, used by everything.

Mesh axes are `("data", "model")`: batch is data-parallel, heads / KV heads /
MLP / vocab are tensor-parallel. The KV cache `[B, Hkv, S, D]` is split over
batch and KV heads only, so every attention kernel runs on local rows (under
`shard_map`) and the full cache is never gathered.

When the model axis is larger than the number of KV heads, each KV head is
replicated `model // Hkv` times (the projection columns and the cache rows):
the KV cache then costs that factor more memory per head, but every device
owns whole heads. `kv_replication` says how many copies; the weights layer
(`weights.place_model`) makes them once, at load time.

This module knows layouts only: the rules depend on the config and on
parameter names, never on the model code, so the cache and the model can
use them (config -> sharding -> cache -> models -> weights).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dustin_jax.config import ConfigError, ModelConfig

# logical axis -> mesh axis (None: replicated)
RULES = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "embed": None,
    "head_dim": None,
    "cache_len": None,
    "draft_tokens": None,
}

# parameter name (last two path parts) -> logical axes of its array. The
# fused projections' columns are grouped (models/decoder.py `qkv_columns`,
# `gate_up_columns`): qkv_proj per KV head (its query heads, k, v), gate_up_proj
# per MLP unit (gate, up), so an even split of the columns over the model axis
# gives each device whole groups whenever the KV heads (the units) divide
# (when they do not, the split cuts groups, XLA gathers the GEMM's output and
# the attention runs replicated).
_PARAM_AXES = {
    ("qkv_proj", "kernel"): ("embed", "kv_heads"), ("qkv_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"), ("o_proj", "bias"): ("embed",),
    ("gate_up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("int8_head", "weight"): ("vocab", "embed"), ("int8_head", "scale"): ("vocab",),
}


def spec(*logical: str | None) -> P:
  """PartitionSpec of an array whose dimensions have these logical axes."""
  return P(*(RULES.get(a) if a else None for a in logical))


def param_axes(path: tuple) -> tuple:
  names = tuple(str(p) for p in path)
  if names == ("embed_tokens",):
    return ("vocab", "embed")
  return _PARAM_AXES.get(names[-2:], (None,))  # norms: replicated


def make_mesh(data: int = 1, model: int = 0, devices: Sequence | None = None) -> Mesh:
  """A ("data", "model") mesh over `devices` (default: all); 0 = the rest."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  if model <= 0 and data <= 0:
    data, model = 1, n
  elif model <= 0:
    model = n // data
  elif data <= 0:
    data = n // model
  if data * model != n:
    raise ConfigError(f"mesh {data}x{model} (data x model) does not cover the {n} devices")
  return Mesh(np.array(devices).reshape(data, model), ("data", "model"))


def draft_mesh(mesh: Mesh | None) -> Mesh | None:
  """The mesh the draft runs on: the same devices, with a model axis of 1
  and the model devices as "replica". A draft is small, so it runs whole on
  every device (its weights and cache replicated; batch still over "data"):
  split like the target, each of its layers and draft passes would add
  collectives (all-reduces after the attention and the MLP, all-gathers
  where its heads do not divide) for a few MB of weights."""
  if mesh is None:
    return None
  d, m = mesh.shape["data"], mesh.shape["model"]
  return Mesh(mesh.devices.reshape(d, 1, m), ("data", "model", "replica"))


def check_batch(mesh: Mesh, batch: int) -> None:
  d = mesh.shape["data"]
  if batch % d:
    raise ConfigError(f"batch_size {batch} is not a multiple of the mesh's data axis {d}")


def kv_replication(cfg: ModelConfig, model: int) -> int:
  """Copies of each KV head so that a model axis larger than the number of
  KV heads still gives every device whole heads (1: none needed or possible,
  e.g. when the query heads do not divide over the axis either)."""
  if model > cfg.num_kv_heads and model % cfg.num_kv_heads == 0 and cfg.num_heads % model == 0:
    return model // cfg.num_kv_heads
  return 1


def _on(size: int, mesh_axis: str | None, mesh: Mesh):
  """Shard a dimension over `mesh_axis` only if it divides evenly; else
  replicate it (XLA keeps the math right either way)."""
  return mesh_axis if mesh_axis and size % mesh.shape[mesh_axis] == 0 else None


def leaves_with_paths(tree) -> list[tuple[tuple, object]]:
  """(path, leaf) of every leaf of a pure dict, each path a tuple of plain
  keys and list indices (`("layers", 0, "mlp", "down_proj", "kernel")`): the
  names `param_axes` and the checkpoint loaders key parameters by."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out.append((tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), leaf))
  return out


def param_shardings(state, mesh: Mesh):
  """A pytree of NamedShardings matching an nnx State of the decoder."""
  pure = nnx.to_pure_dict(state)
  def one(path, x):
    axes = param_axes(path)
    if len(axes) != np.ndim(x):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(*(_on(n, RULES.get(a) if a else None, mesh)
                                   for n, a in zip(np.shape(x), axes))))
  shardings = [one(path, x) for path, x in leaves_with_paths(pure)]
  tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(pure), shardings)
  out = jax.tree_util.tree_map(lambda x: x, state)  # same structure as state
  nnx.replace_by_pure_dict(out, tree)
  return out


def shard_params(state, mesh: Mesh):
  return jax.device_put(state, param_shardings(state, mesh))


def cache_spec(num_kv_heads: int | None = None, mesh: Mesh | None = None) -> P:
  """[B, Hkv, S, D]: batch over data, KV heads over model when they divide."""
  heads = RULES["kv_heads"] if mesh is None else _on(num_kv_heads, RULES["kv_heads"], mesh)
  return P(RULES["batch"], heads, None, None)


def heads_spec(num_heads: int, mesh: Mesh) -> P:
  """[B, T, H, D] activations of the attention: like the cache."""
  return P(RULES["batch"], None, _on(num_heads, RULES["heads"], mesh), None)


def batch_spec(ndim: int = 1) -> P:
  return spec("batch", *([None] * (ndim - 1)))


def shard_batch_tree(tree, mesh: Mesh):
  """Caches: [B, Hkv, S, D] split over batch and KV heads; every other array
  with a leading batch axis split over batch; scalars and keys replicated."""
  def place(x):
    if not hasattr(x, "ndim") or x.ndim == 0 or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.device_put(x, NamedSharding(mesh, P()))
    if x.ndim == 4:
      return jax.device_put(x, NamedSharding(mesh, cache_spec(x.shape[1], mesh)))
    return jax.device_put(x, NamedSharding(mesh, batch_spec(x.ndim)))
  return jax.tree_util.tree_map(place, tree)


# --------------------------------------------------------- memory planning
@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per device of one speculative-decoding configuration."""
  devices: int
  data: int
  model: int
  weights: int
  target_cache: int
  draft_cache: int
  workspace: int
  kv_replication: int
  capacity: int | None = None
  prefill: int = 0      # the prefill's activations (live before the decode's workspace)

  @property
  def total(self) -> int:
    """The peak: weights and caches, plus the larger of the prefill's and
    the decode step's workspace (they are never live together)."""
    return (self.weights + self.target_cache + self.draft_cache
            + max(self.workspace, self.prefill))

  def fits(self) -> bool:
    return self.capacity is None or self.total <= self.capacity

  def table(self) -> str:
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    rows = [("weights (target + draft)", self.weights), ("target KV cache", self.target_cache),
            ("draft KV cache", self.draft_cache), ("prefill activations", self.prefill),
            ("decode workspace", self.workspace), ("total (peak)", self.total)]
    head = (f"memory per device, {self.devices} devices (data {self.data} x model {self.model})"
            + (f", KV heads replicated x{self.kv_replication}" if self.kv_replication > 1 else ""))
    lines = [head] + [f"  {name:26s}{gib(b)}" for name, b in rows]
    if self.capacity is not None:
      lines.append(f"  {'capacity':26s}{gib(self.capacity)}")
    return "\n".join(lines)


def int8_head_bytes(cfg: ModelConfig) -> int:
  """Bytes of an LM head kept as int8 rows with one f32 scale per row
  (`models.decoder.Int8Head`)."""
  return cfg.vocab_size * cfg.hidden_size + 4 * cfg.vocab_size


def _shards(n: int, m: int) -> int:
  return m if n % m == 0 else 1


def memory_plan(target: ModelConfig, draft: ModelConfig | None, *, batch: int, max_len: int,
                data: int, model: int, gamma: int = 4, capacity: int | None = None,
                prompt_len: int | None = None, token_block: int = 8192,
                f32_prefill_attention: bool = False,
                draft_int8_head: bool = False) -> MemoryPlan:
  """Per-device bytes, counted from the shapes alone (before any allocation).

  Weights: tensor-parallel matrices split over `model`, norms replicated;
  caches: split over `data` (batch) and `model` (KV heads, after replication);
  the draft whole on every device (`draft_mesh`), its LM head as int8 rows
  and f32 scales with `draft_int8_head` (beside a tied embedding);
  workspace: the verify pass's f32 logits, the activations of the widest
  layer and the selection signals; prefill: the layer-major prefill's
  activations over `prompt_len` (default `max_len`) tokens of every
  sequence (the residual stream in and out, q and the attention output, k
  and v, one tile of `token_block` tokens through the MLP; with
  `f32_prefill_attention`, the f32 copies of q, k, v and the output that the
  blockwise jnp attention makes) -- lower bounds that exclude XLA's own
  temporary buffers (leave headroom)."""
  def weights(cfg: ModelConfig, model: int) -> int:
    el = jnp.dtype(cfg.dtype).itemsize
    d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_kv_heads * kv_replication(cfg, model)
    q, qkv = cfg.num_heads * hd, (cfg.num_heads + 2 * kv) * hd  # split like param_shardings
    per_layer = (d * qkv // _shards(qkv, model) + d * q // _shards(q, model)
                 + 2 * d * f // _shards(2 * f, model) + d * f // _shards(f, model) + 2 * d)
    if cfg.qkv_bias:
      per_layer += qkv // _shards(qkv, model)
    emb = v * d // _shards(v, model) * (1 if cfg.tie_embeddings else 2)
    return (cfg.num_layers * per_layer + emb + d) * el

  def draft_weights(cfg: ModelConfig) -> int:
    if not draft_int8_head:
      return weights(cfg, 1)
    untied_head = (0 if cfg.tie_embeddings else
                   cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize)
    return weights(cfg, 1) - untied_head + int8_head_bytes(cfg)

  def cache(cfg: ModelConfig, model: int) -> int:
    el = jnp.dtype(cfg.dtype).itemsize
    kv = cfg.num_kv_heads * kv_replication(cfg, model)
    return (2 * cfg.num_layers * (batch // data) * (kv // _shards(kv, model)) * max_len
            * cfg.head_dim * el)

  models = [target] + ([draft] if draft is not None else [])
  b = batch // data
  t = gamma + 1
  logits = 4 * b * t * max(c.vocab_size for c in models) * 2  # target + draft distributions
  acts = 4 * b * t * max(max(c.intermediate_size, c.num_heads * c.head_dim) for c in models) * 4
  signals = 2 * 4 * b * max_len

  def prefill(cfg: ModelConfig) -> int:
    el = jnp.dtype(cfg.dtype).itemsize
    tokens = b * (prompt_len or max_len)
    q = cfg.num_heads * cfg.head_dim // _shards(cfg.num_heads, model)
    kv = 2 * cfg.num_kv_heads * kv_replication(cfg, model) * cfg.head_dim
    kv //= _shards(cfg.num_kv_heads * kv_replication(cfg, model), model)
    mlp = 3 * min(token_block, tokens) * cfg.intermediate_size // _shards(cfg.intermediate_size,
                                                                          model)
    f32 = tokens * (2 * q + kv) * 4 if f32_prefill_attention else 0
    return (tokens * (2 * cfg.hidden_size + 2 * q + kv) + mlp) * el + f32

  return MemoryPlan(devices=data * model, data=data, model=model,
                    weights=weights(target, model) + (draft_weights(draft) if draft else 0),
                    target_cache=cache(target, model), draft_cache=cache(draft, 1) if draft else 0,
                    workspace=logits + acts + signals, kv_replication=kv_replication(target, model),
                    capacity=capacity, prefill=max(prefill(c) for c in models))


def check_fits(plan: MemoryPlan) -> None:
  if plan.fits():
    return
  raise ConfigError(
      "this configuration does not fit: " + f"{plan.total / 2**30:.1f} GiB per device needed, "
      f"{plan.capacity / 2**30:.1f} GiB available.\n{plan.table()}\n"
      "fix: more devices (mesh.model / mesh.data), a smaller batch_size, or a shorter max_len; "
      "XLA's allocator takes 75% of the device by default, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "
      "(scripts.decode: --config.mem_fraction=0.95) gives it more")


DEFAULT_MEM_FRACTION = 0.75  # XLA's allocator's share of a GPU when none is set


def device_capacity() -> int | None:
  """Bytes XLA's allocator may use on one accelerator (None on CPU or when
  unknown): XLA_PYTHON_CLIENT_MEM_FRACTION of the device, 75% by default.

  XLA's VMM allocator (which the graph flags' update mode runs on,
  `config.append_xla_flags`) reports no memory stats; it holds to the same
  fraction of the device's memory, which the CUDA driver gives then."""
  d = jax.devices()[0]
  if d.platform == "cpu":
    return None
  try:
    stats = d.memory_stats()
  except Exception:  # noqa: BLE001 -- some backends have no memory stats
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  if d.platform != "gpu":
    return None
  total = cuda_device_memory(getattr(d, "local_hardware_id", d.id))
  return None if total is None else int(total * mem_fraction())


def mem_fraction() -> float:
  """The share of a GPU XLA's allocator takes (its environment variables)."""
  value = (os.environ.get("XLA_CLIENT_MEM_FRACTION")
           or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))
  return float(value) if value else DEFAULT_MEM_FRACTION


def cuda_device_memory(ordinal: int) -> int | None:
  """Total memory of CUDA device `ordinal` from the driver
  (cuDeviceTotalMem), or None where the driver cannot be asked."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
    device, total = ctypes.c_int(), ctypes.c_size_t()
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal)
        or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device)):
      return None
    return total.value
  except (OSError, AttributeError):
    return None

