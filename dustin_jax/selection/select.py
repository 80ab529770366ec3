"""The tiered top-k that turns importance signals into `I_verify`.

Dustin verifies with one fixed-size set of K context rows per sequence,
shared by every layer, KV head and verify query:

  1. the first `n_sink` and the last `n_window` committed rows, always;
  2. the top-`m` of the rest by the first signal (Dustin: draft-lookahead);
  3. the rest of the budget by the second signal (Dustin: target-historical)
     among the rows not chosen yet.

Only committed rows (`pos < lengths[b]`) are candidates: the new block, the
stale rows of rejected tokens and the padding of shorter or finished
sequences never are. A context shorter than K is selected whole and the
remaining slots are -1, so a budget >= context is exactly full verification.

Ties are broken towards the lower position (`lax.top_k` on CPU, the exact
Pallas top-k of `kernels.topk` on GPU; on TPU `select_topk` uses
`lax.approx_max_k`, which gives no such guarantee). The result is ascending
among the valid indices, -1 padding last.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from dustin_jax.config import ConfigError
from dustin_jax.selection.base import sink_window_indices
from kernels import common
from kernels.srh_scores.ops import select_topk
from kernels.topk.ops import topk


def check_budget(budget: int, n_sink: int, n_window: int, m: int = 0, *, who: str = "policy"):
  """One ConfigError for the first inconsistent size (shared by the policies
  and the SRH file loader)."""
  for name, v in (("budget", budget), ("n_sink", n_sink), ("n_window", n_window), ("m", m)):
    if not isinstance(v, int) or isinstance(v, bool):
      raise ConfigError(f"{who}: {name} must be an int, got {v!r}")
  if budget < 1:
    raise ConfigError(f"{who}: budget must be >= 1, got {budget}")
  if n_sink < 0 or n_window < 0:
    raise ConfigError(f"{who}: n_sink and n_window must be >= 0, got {n_sink}, {n_window}")
  if budget < n_sink + n_window:
    raise ConfigError(f"{who}: budget={budget} is smaller than n_sink + n_window = "
                      f"{n_sink} + {n_window}; raise the budget or shrink the sink/window")
  free = budget - n_sink - n_window
  if not 0 <= m <= free:
    raise ConfigError(f"{who}: m={m} must lie in [0, budget - n_sink - n_window = {free}]")


def committed_mask(lengths: jax.Array, max_len: int) -> jax.Array:
  """bool[B, S]: the committed rows of each sequence."""
  pos = jnp.arange(max_len, dtype=jnp.int32)[None]
  return pos < lengths.astype(jnp.int32)[:, None]


def sink_window_mask(lengths: jax.Array, max_len: int, n_sink: int, n_window: int) -> jax.Array:
  """bool[B, S]: the rows of `base.sink_window_indices` as a mask."""
  lengths = lengths.astype(jnp.int32)[:, None]
  pos = jnp.arange(max_len, dtype=jnp.int32)[None]
  return ((pos < n_sink) | (pos >= lengths - n_window)) & (pos < lengths)


def top_tier(scores: jax.Array, allowed: jax.Array, k: int):
  """The top-`k` rows of `scores[B, S]` among `allowed[B, S]`.

  Returns (indices int32[B, k'] with -1 where fewer than k rows are allowed,
  the chosen rows as bool[B, S]); k' = min(k, S)."""
  b, s = scores.shape
  k = min(k, s)
  if k <= 0:
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, s), bool)
  masked = jnp.where(allowed, scores.astype(jnp.float32), -jnp.inf)
  if common.resolve_impl("auto") == "gpu":
    vals, idx = topk(masked, k)  # the same set as lax.top_k, in index order
  else:
    vals, idx = select_topk(masked, k)
  idx = jnp.where(vals > -jnp.inf, idx, -1)
  return idx, indices_to_mask(idx, s)


def indices_to_mask(indices: jax.Array, max_len: int) -> jax.Array:
  """bool[B, S] with True at the valid (>= 0) entries of `indices[B, K]`."""
  b = indices.shape[0]
  safe = jnp.where(indices >= 0, indices, max_len)  # out of range: dropped
  rows = jnp.arange(b)[:, None]
  return jnp.zeros((b, max_len), bool).at[rows, safe].set(True, mode="drop")


def sort_and_pad(indices: jax.Array, budget: int) -> jax.Array:
  """Ascending valid indices first, -1 after, exactly `budget` columns."""
  big = jnp.iinfo(jnp.int32).max
  key = jnp.sort(jnp.where(indices >= 0, indices, big), axis=1)
  key = jnp.where(key == big, -1, key).astype(jnp.int32)
  n = key.shape[1]
  if n < budget:
    key = jnp.pad(key, ((0, 0), (0, budget - n)), constant_values=-1)
  return key[:, :budget]


def tiered_select(lengths: jax.Array, max_len: int, budget: int, n_sink: int, n_window: int,
                  tiers: Sequence[tuple[jax.Array, int]]) -> jax.Array:
  """int32[B, budget] `I_verify`: sink + window, then each `(scores[B, S],
  size)` tier in order among the rows not chosen yet. The tier sizes must
  add up to `budget - n_sink - n_window`."""
  if sum(k for _, k in tiers) != budget - n_sink - n_window:
    raise ValueError(f"tier sizes {[k for _, k in tiers]} do not fill budget - n_sink - "
                     f"n_window = {budget - n_sink - n_window}")
  lengths = lengths.astype(jnp.int32)
  taken = sink_window_mask(lengths, max_len, n_sink, n_window)
  free = committed_mask(lengths, max_len) & ~taken
  parts = [sink_window_indices(lengths, n_sink, n_window)]
  for scores, k in tiers:
    idx, chosen = top_tier(scores, free, k)
    parts.append(idx)
    free = free & ~chosen
  return sort_and_pad(jnp.concatenate(parts, axis=1), budget)
