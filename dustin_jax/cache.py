"""The functional KV cache.

Layout, fixed for the whole project (the kernels read it as is):
per layer `k, v: [B, Hkv, S_max, D]` (head-major: one KV head's rows are
contiguous, so split-K kernels stream them), and `lengths: int32[B]`, the
number of committed tokens of each sequence (a ragged batch).

A forward pass over T new tokens writes them at `lengths[b] .. lengths[b]+T-1`
without moving `lengths`; `commit(n)` advances it. Committing fewer than were
written is a free rollback: the stale rows sit past `lengths`, every attention
masks them, and the next write overwrites them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dustin_jax.config import ModelConfig
from dustin_jax.sharding import batch_spec, cache_spec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None,
           mesh=None) -> "KVCache":
    """An empty cache; under `mesh`, allocated directly in its shards."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    def make():
      zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
      return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))
    return _build(make, cfg, mesh)

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

  def commit(self, n: jax.Array) -> "KVCache":
    """Advance each sequence by `n[b]` tokens (those already written)."""
    return dataclasses.replace(self, lengths=self.lengths + n.astype(jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

  def with_layer(self, layer: int, k: jax.Array, v: jax.Array) -> "KVCache":
    ks, vs = list(self.k), list(self.v)
    ks[layer], vs[layer] = k, v
    return dataclasses.replace(self, k=tuple(ks), v=tuple(vs))


def write_rows(cache_layer: jax.Array, new: jax.Array,
               start: jax.Array) -> jax.Array:
  """Write `new[B, T, Hkv, D]` into `cache_layer[B, Hkv, S, D]` at rows
  `start[b] .. start[b]+T-1` of each sequence.

  A scatter that drops rows past `S_max` (padding of a ragged prefill chunk)
  instead of clamping the start, which would overwrite committed rows; it
  runs in place when the cache buffer is donated."""
  b, t = new.shape[:2]
  rows = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  seq = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  return cache_layer.at[seq, :, rows].set(new.astype(cache_layer.dtype), mode="drop")


def cache_shardings(cfg: ModelConfig, mesh) -> KVCache:
  """A KVCache of NamedShardings: the rows split over batch ("data") and KV
  heads ("model"), the lengths over batch."""
  rows = NamedSharding(mesh, cache_spec(cfg.num_kv_heads, mesh))
  return KVCache(k=(rows,) * cfg.num_layers, v=(rows,) * cfg.num_layers,
                 lengths=NamedSharding(mesh, batch_spec(1)))


def _build(make, cfg: ModelConfig, mesh) -> KVCache:
  """`make()` (a KVCache) computed by one program; under `mesh` directly in
  its shards (`cache_shardings`), never whole on one device."""
  if mesh is None:
    return jax.jit(make)()
  return jax.jit(make, out_shardings=cache_shardings(cfg, mesh))()
