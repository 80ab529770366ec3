"""Pure-jnp exact top-k: the oracle of the GPU kernel and the CPU fallback.

Contract (``topk_reference(scores, k)``, scores [B, S] float, 1 <= k <= S):
the k entries of each row that ``lax.top_k`` selects -- the k largest
values, ties broken by the lower index -- as (values f32[B, k], indices
int32[B, k]) in ascending index order (not by value).

Order: a float is compared through ``sortable_key``, an int32 whose signed
order is the total order of the float's bits: -0.0 < +0.0 (lax.top_k on CPU
orders them so), -inf below every finite value, and NaNs by their bits
(positive NaNs above +inf, negative ones below -inf, again as lax.top_k on
CPU).  NaN scores are not an input the callers produce; that order is only
what they get.  Rows with fewer than k finite values select -inf entries,
the lowest-indexed ones first, exactly as lax.top_k.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sortable_key(x):
  """int32 key of f32 x whose signed order is x's order: the bits of a
  non-negative float already order as int32; a negative float's magnitude
  bits are flipped (more negative -> smaller key), its sign bit kept."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def check_topk_args(scores, k) -> int:
  if scores.ndim != 2:
    raise ValueError(f"scores must be [B, S], got shape {scores.shape}")
  if not jnp.issubdtype(scores.dtype, jnp.floating):
    raise ValueError(f"scores must be floating point, got {scores.dtype}")
  k = int(k)
  if not 1 <= k <= scores.shape[1]:
    raise ValueError(f"k={k} must be in [1, S={scores.shape[1]}]")
  return k


def topk_reference(scores, k) -> tuple[jax.Array, jax.Array]:
  """(values f32[B, k], indices int32[B, k]), ascending index: the k largest
  of each row, ties to the lower index (lax.top_k's set)."""
  k = check_topk_args(scores, k)
  x = scores.astype(jnp.float32)
  B, S = x.shape
  key = sortable_key(x)
  tau = jnp.sort(key, axis=1)[:, S - k, None]  # the k-th largest key
  above = key > tau
  tie = key == tau
  # Every key above tau is in; the first k - #above keys equal to tau are.
  need = k - jnp.sum(above, axis=1, keepdims=True, dtype=jnp.int32)
  take = above | (tie & (jnp.cumsum(tie, axis=1, dtype=jnp.int32) <= need))
  # Exactly k entries are taken: entry p goes to slot (#taken before p).
  slot = jnp.where(take, jnp.cumsum(take, axis=1, dtype=jnp.int32) - 1, k)
  rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, S))
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
  indices = jnp.zeros((B, k), jnp.int32).at[rows, slot].set(pos, mode="drop")
  return jnp.take_along_axis(x, indices, axis=1), indices
