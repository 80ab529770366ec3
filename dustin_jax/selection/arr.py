"""Attention Recovery Rate (ARR): how much of the target's attention a
verification set recovers.

ARR of a verification set I at one verify step: for every layer, query head
and verify query of the target, take its FULL-cache attention probabilities,
keep the committed-context part (`p < lengths[b]`), renormalise it to sum to
1, and count the share that falls on I; average over queries, heads and
layers (per sequence). Choices:

* the new block is left out of both numerator and denominator: every verify
  set attends to it, so counting it would only inflate every policy alike;
  full verification (or a budget >= context) has ARR exactly 1;
* sink and window rows are part of I (they are attended), so they count;
* the reference attention is the target's full-cache pass over the block
  (its own queries at every layer), not the sparse pass: ARR asks how much of
  the attention the real model would pay is recovered;
* the probabilities come from `kernels.srh_scores` (one head, one query per
  call, vmapped): no second attention implementation
  (`signals.attention_weights`).

ARR is linear in I (a sum of per-row weights), so the Oracle policy's top-K
of those weights is the highest ARR any K-row set can reach.

The speculative step measures it when asked
(`speculative.StepOptions(measure_arr=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dustin_jax.cache import KVCache
from dustin_jax.decoding import Model
from dustin_jax.selection.policies import Oracle
from dustin_jax.selection.signals import attention_weights


def layer_weights(taps, cache: KVCache, *, impl: str = "auto") -> jax.Array:
  """f32[B, L, S]: per tapped layer (ascending), the mean over query heads
  and verify queries of the context-renormalised full attention (each row
  sums to 1 over the committed context). `cache` holds the block at
  `lengths[b] ..` (as after the verify forward, before commit)."""
  return jnp.stack([attention_weights(taps[l], cache.k[l], cache.lengths, impl=impl)
                    for l in sorted(taps)], axis=1)


def arr_of_indices(weights: jax.Array, kv_indices: jax.Array | None, lengths: jax.Array):
  """(arr f32[B], per-layer arr f32[B, L]) of the verification set
  `kv_indices[B, K]` (-1 padding, duplicate free; None: the full cache)
  under `weights[B, L, S]` from `layer_weights`."""
  b, n_layers, _ = weights.shape
  if kv_indices is None:
    per_layer = jnp.ones((b, n_layers), jnp.float32)
  else:
    idx = kv_indices.astype(jnp.int32)
    ok = (idx >= 0) & (idx < lengths.astype(jnp.int32)[:, None])
    got = jnp.take_along_axis(weights, jnp.where(ok, idx, 0)[:, None, :], axis=2)  # [B, L, K]
    per_layer = jnp.sum(jnp.where(ok[:, None, :], got, 0.0), axis=2)
  return jnp.mean(per_layer, axis=1), per_layer


def arr_of_step(target: Model, cache: KVCache, block: jax.Array, kv_indices, *,
                impl: str = "auto"):
  """ARR of `kv_indices` for one verify block, from outside a step: runs the
  target over `block[B, gamma+1]` with the full `cache` (pre-commit lengths)
  and measures. Returns (arr f32[B], per-layer f32[B, L])."""
  model = nnx.merge(target.graphdef, target.state)
  _, full, taps = model(block, cache, tap_layers=tuple(range(target.cfg.num_layers)), impl=impl)
  return arr_of_indices(layer_weights(taps, full, impl=impl), kv_indices, cache.lengths)


def oracle_indices(target: Model, cache: KVCache, block: jax.Array, budget: int, *,
                   impl: str = "auto") -> jax.Array:
  """int32[B, budget]: the Oracle's verification set for `block[B, gamma+1]`
  verified against `cache` (pre-commit lengths), from outside a step."""
  oracle = Oracle(budget=budget, num_layers=target.cfg.num_layers, impl=impl)
  model = nnx.merge(target.graphdef, target.state)
  _, full, taps = model(block, cache, tap_layers=oracle.full_verify_tap_layers, impl=impl)
  signals = oracle.observe_full_verify(oracle.init(cache.batch, cache.max_len), taps, full,
                                       block.shape[1] - 1)
  return oracle.select(signals, cache, block.shape[1] - 1)
