"""Importance signals over the whole context, each a f32[B, S] map.

* `srh_signal`: attention probabilities of a few semantic retrieval heads
  (SRHs), through `kernels.srh_scores` -- Dustin's draft-lookahead signal
  (the draft's queries for the tokens it proposes) and target-historical
  signal (the target's verify queries of the previous step). Only the
  configured (layer, head) pairs are read: one `srh_scores` call per
  configured layer, on that layer's selected query heads and the KV heads
  they read.
* `attention_weights`: the target's full attention at the verify queries,
  renormalised over the committed context per (head, query) -- what ARR and
  the Oracle policy rank by (arr.py).
* Quest page metadata (`init_pages`, `update_pages`, `page_scores`): per
  page of `page` rows the elementwise min and max of the keys.

Signals are combined across layers and draft queries with the same `reduce`
the kernel applies across heads and queries ("sum" or "max").
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from dustin_jax.cache import KVCache
from kernels import common
from kernels.srh_scores.ops import srh_scores


def heads_by_layer(heads) -> dict[int, tuple[int, ...]]:
  """{layer: sorted query heads} of (layer, head) pairs."""
  out: dict[int, list[int]] = {}
  for layer, head in heads:
    out.setdefault(int(layer), []).append(int(head))
  return {layer: tuple(sorted(set(hs))) for layer, hs in sorted(out.items())}


def combine(a: jax.Array, b: jax.Array, reduce: str) -> jax.Array:
  return a + b if reduce == "sum" else jnp.maximum(a, b)


def srh_signal(heads, taps: Mapping[int, jax.Array], cache: KVCache, *, reduce: str = "sum",
               impl: str = "auto") -> jax.Array:
  """f32[B, S]: the SRH scores of `heads` ((layer, query head) pairs) for the
  queries `taps[layer]: [B, T, Hq, D]`, query t at position
  `cache.lengths[b] + t`, over the keys `p <= cache.lengths[b] + t` of
  `cache`; summed (or maxed) over heads, queries and layers."""
  acc = None
  for layer, hs in heads_by_layer(heads).items():
    if layer not in taps:
      raise ValueError(f"SRH layer {layer} was not tapped (tapped: {sorted(taps)}): the "
                       "policy's *_tap_layers must name it")
    q = taps[layer]
    k = cache.k[layer]
    hq, hkv = q.shape[2], k.shape[1]
    if max(hs) >= hq:
      raise ValueError(f"SRH head {max(hs)} of layer {layer} is out of range: the model has "
                       f"{hq} query heads")
    group = hq // hkv
    contiguous = hs == tuple(range(hs[0], hs[-1] + 1))
    q = q[:, :, hs[0]:hs[-1] + 1] if contiguous else q[:, :, jnp.asarray(hs)]
    s = srh_scores(q, k, cache.lengths, tuple(h // group for h in hs), reduce=reduce,
                   impl=impl)
    acc = s if acc is None else combine(acc, s, reduce)
  if acc is None:
    raise ValueError("srh_signal needs at least one (layer, head)")
  return acc


def restrict_and_pool(scores: jax.Array, lengths: jax.Array, pool: int) -> jax.Array:
  """Zero the rows at or past `lengths[b]` (block, stale, padding), then
  max-pool over `pool` neighbouring rows (odd; 1 = none), so a salient
  token pulls its neighbours in (SnapKV-style clustering)."""
  pos = jnp.arange(scores.shape[1], dtype=jnp.int32)[None]
  scores = jnp.where(pos < lengths.astype(jnp.int32)[:, None], scores.astype(jnp.float32), 0.0)
  if pool <= 1:
    return scores
  half = pool // 2
  return jax.lax.reduce_window(scores, -jnp.inf, jax.lax.max, (1, pool), (1, 1),
                               ((0, 0), (half, half)))


# ------------------------------------------------------ full attention (ARR)
def attention_weights(q: jax.Array, k: jax.Array, lengths: jax.Array, *,
                      impl: str = "auto") -> jax.Array:
  """f32[B, S]: mean over the query heads and verify queries of one layer of
  the attention probabilities renormalised over the committed context.

  q: [B, T, Hq, D] the layer's verify queries, query t at position
  `lengths[b] + t`; k: [B, Hkv, S, D] with the block already written at
  `lengths[b] ..`. For each (head, query) the full-cache softmax (context
  and, causally, the block) is taken through `srh_scores` (one head, one
  query: a vmap of single calls), its context part `p < lengths[b]` is
  divided by the context mass, and the result averaged: each row sums to 1
  over the context (0 where the context is empty). The block is left out of
  both the mass and the normaliser because every verify set attends to it.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  lengths = lengths.astype(jnp.int32)
  ctx = jnp.arange(k.shape[2], dtype=jnp.int32)[None] < lengths[:, None]  # [B, S]
  total = None
  for g in range(hkv):
    def one(qv, off, g=g):  # qv: [B, D] one head, one query at lengths + off
      return srh_scores(qv[:, None, None, :], k, lengths + off, (g,), reduce="sum", impl=impl)
    qg = q[:, :, g * group:(g + 1) * group]                    # [B, T, G, D]
    per_head = jax.vmap(one, in_axes=(1, None))                 # over G: [G, B, S]
    probs = jax.vmap(per_head, in_axes=(1, 0))(qg, jnp.arange(t, dtype=jnp.int32))  # [T, G, B, S]
    probs = jnp.where(ctx, probs, 0.0)
    mass = jnp.sum(probs, axis=-1, keepdims=True)
    part = jnp.sum(probs / jnp.where(mass > 0, mass, 1.0), axis=(0, 1))
    total = part if total is None else total + part
  return total / (hq * t)


# ------------------------------------------------------------- Quest pages
def init_pages(batch: int, num_kv_heads: int, max_len: int, head_dim: int, page: int, dtype):
  """Empty page metadata (kmin = +inf, kmax = -inf): [B, Hkv, P, D] each."""
  shape = (batch, num_kv_heads, common.cdiv(max_len, page), head_dim)
  return jnp.full(shape, jnp.inf, dtype), jnp.full(shape, -jnp.inf, dtype)


def rebuild_pages(k: jax.Array, hi: jax.Array, page: int):
  """Page min/max of the rows `< hi[b]` of `k: [B, Hkv, S, D]`."""
  b, h, s, d = k.shape
  n = common.cdiv(s, page)
  kp = jnp.pad(k, ((0, 0), (0, 0), (0, n * page - s), (0, 0))).reshape(b, h, n, page, d)
  rows = jnp.arange(n * page, dtype=jnp.int32).reshape(n, page)
  live = (rows[None] < hi.astype(jnp.int32)[:, None, None])[:, None, :, :, None]
  kmin = jnp.min(jnp.where(live, kp, jnp.inf), axis=3)
  kmax = jnp.max(jnp.where(live, kp, -jnp.inf), axis=3)
  return kmin.astype(k.dtype), kmax.astype(k.dtype)


def update_pages(kmin, kmax, k: jax.Array, lo: jax.Array, hi: jax.Array, page: int,
                 n_pages: int):
  """Bring page metadata made for the rows `< lo[b]` up to the rows `< hi[b]`.

  Recomputes (from all their rows below hi) only the `n_pages` pages from
  the one holding row `lo[b]`; when some sequence moved further than those
  cover (the first call after prefill), rebuilds every page instead."""
  lo = lo.astype(jnp.int32)
  hi = hi.astype(jnp.int32)
  b, h, s, d = k.shape
  n_all = kmin.shape[2]

  def incremental(_):
    pid = lo[:, None] // page + jnp.arange(n_pages, dtype=jnp.int32)[None]    # [B, n]
    rows = pid[:, :, None] * page + jnp.arange(page, dtype=jnp.int32)[None, None]  # [B, n, page]
    live = rows < hi[:, None, None]
    safe = jnp.where(live, rows, 0).reshape(b, 1, n_pages * page, 1)
    kr = jnp.take_along_axis(k, safe, axis=2).reshape(b, h, n_pages, page, d)
    lv = live[:, None, :, :, None]
    new_min = jnp.min(jnp.where(lv, kr, jnp.inf), axis=3).astype(kmin.dtype)   # [B, H, n, D]
    new_max = jnp.max(jnp.where(lv, kr, -jnp.inf), axis=3).astype(kmax.dtype)
    touched = pid * page < hi[:, None]
    dst = jnp.where(touched, pid, n_all)  # pages without a committed row: dropped
    bi = jnp.arange(b)[:, None]
    put = lambda meta, new: meta.at[bi, :, dst].set(jnp.moveaxis(new, 2, 1), mode="drop")
    return put(kmin, new_min), put(kmax, new_max)

  def rebuild(_):
    mn, mx = rebuild_pages(k, hi, page)
    return mn.astype(kmin.dtype), mx.astype(kmax.dtype)

  far = jnp.any(hi > (lo // page + n_pages) * page)
  return jax.lax.cond(far, rebuild, incremental, None)


def page_scores(q: jax.Array, kmin: jax.Array, kmax: jax.Array, hi: jax.Array, page: int, *,
                reduce: str = "sum") -> jax.Array:
  """f32[B, P] Quest page importance for the queries `q: [B, T, Hq, D]`.

  Per (query head, query) Quest's upper bound of the logit over a page,
  `scale * sum_d max(q_d kmin_d, q_d kmax_d)`, softmaxed over the pages
  holding a row `< hi[b]` (the estimated attention share of each page);
  then summed (or maxed) over heads and queries. One verification set is
  shared by every head, so the per-head bounds must be put on one scale:
  the softmax does that, as the SRH signals do for exact probabilities."""
  b, t, hq, d = q.shape
  hkv, n = kmin.shape[1], kmin.shape[2]
  valid = (jnp.arange(n, dtype=jnp.int32)[None] * page) < hi.astype(jnp.int32)[:, None]  # [B, P]
  vm = valid[:, None, :, None]
  lo_k = jnp.where(vm, kmin.astype(jnp.float32), 0.0)
  hi_k = jnp.where(vm, kmax.astype(jnp.float32), 0.0)
  qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
  hp = jax.lax.Precision.HIGHEST
  bound = (jnp.einsum("btkgd,bkpd->btkgp", jnp.maximum(qg, 0.0), hi_k, precision=hp)
           + jnp.einsum("btkgd,bkpd->btkgp", jnp.minimum(qg, 0.0), lo_k, precision=hp))
  bound = bound * common.default_scale(d, None)
  bound = jnp.where(valid[:, None, None, None], bound, -jnp.inf)
  share = jax.nn.softmax(bound, axis=-1)
  share = jnp.where(valid[:, None, None, None], share, 0.0)  # no valid page: NaN -> 0
  return jnp.sum(share, axis=(1, 2, 3)) if reduce == "sum" else jnp.max(share, axis=(1, 2, 3))
