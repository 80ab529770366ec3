"""Random decoding state for the benchmarks: a KV cache of random rows.

The speed of a decode step does not depend on the values in the cache, and a
32k-token prompt need not be prefilled to time the steps that follow it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dustin_jax.cache import KVCache, cache_shardings
from dustin_jax.config import ModelConfig
from dustin_jax.weights import random_fill


def random_cache(cfg: ModelConfig, batch: int, max_len: int, context: int, seed: int,
                 mesh=None) -> KVCache:
  """A cache of random rows (`weights.random_fill`), committed up to
  `context`; made by one program, under `mesh` directly in its shards
  (`cache.cache_shardings`), never whole on one device."""
  shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  dt = jnp.dtype(cfg.dtype)
  def make():
    rows = lambda s: tuple(random_fill(shape, dt, "uniform", s + i) for i in range(cfg.num_layers))
    return KVCache(k=rows(seed), v=rows(seed + 7919),
                   lengths=jnp.full((batch,), context, jnp.int32))
  if mesh is None:
    return jax.jit(make)()
  return jax.jit(make, out_shardings=cache_shardings(cfg, mesh))()
