"""Public entry points: SRH importance scores and the top-k selection."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels import common
from kernels.srh_scores.gpu import srh_scores_gpu
from kernels.srh_scores.reference import check_srh_args, srh_scores_reference
from kernels.srh_scores.tpu import srh_scores_tpu


def srh_scores(q, k, lengths, kv_head, *, q_valid=None, reduce="sum",
               scale=None, impl="auto", interpret=False, **tuning) -> jax.Array:
  """Full-context attention importance of a few selected heads.

  Args:
    q: [B, T, n, D] the n selected query heads of one layer.
    k: [B, Hkv, S, D] that layer's key cache.
    lengths: int32[B]; query t sees key positions p <= lengths[b] + t.
    kv_head: static tuple of n ints, the KV head each selected head reads.
    q_valid: optional bool[B, T]; False queries contribute nothing.
    reduce: "sum" or "max" over (heads x valid queries) of the probabilities.
    scale: softmax scale, default 1/sqrt(D).
    impl: "auto" | "reference" | "gpu" | "tpu"; interpret: Pallas interpret.
    **tuning: gpu: block_k, chunk, block_s, num_warps, num_stages;
      tpu: block_k, block_s.
  Returns:
    f32[B, S] scores, 0 where no query may look.
  """
  kv_head = check_srh_args(q, k, kv_head, reduce)
  impl = common.resolve_impl(impl)
  if impl == "reference":
    return srh_scores_reference(q, k, lengths, kv_head, q_valid=q_valid,
                                reduce=reduce, scale=scale)
  if impl == "gpu":
    return srh_scores_gpu(q, k, lengths, kv_head, q_valid=q_valid,
                          reduce=reduce, scale=scale, interpret=interpret,
                          **tuning)
  return srh_scores_tpu(q, k, lengths, kv_head, q_valid=q_valid,
                        reduce=reduce, scale=scale, interpret=interpret,
                        **tuning)


def select_topk(scores, k, *, method="auto", segment=None
                ) -> tuple[jax.Array, jax.Array]:
  """Top-k of scores along the last axis: (values, int32 indices), sorted by
  value (descending; ties: lower index first, as lax.top_k).

  method: "auto" (TPU: lax.approx_max_k; GPU: "two_stage" when the row is
  longer than one segment, else lax.top_k; CPU: lax.top_k), "lax"
  (lax.top_k), "approx" (lax.approx_max_k) or "two_stage": exact top-k of
  each ``segment``-long slice (segment >= k, default max(4k, 2048)) and then
  of those candidates, both with lax.top_k: sorts of short rows instead of
  one long sort, same values and indices as lax.top_k (ties: lower index).
  On GPU, lax.top_k with a large k sorts the whole row (XLA's fast TopK
  kernel takes k <= 16), so the two stages are faster on long rows
  (kernels/NOTES.md).
  """
  if method == "auto":
    plat = common.backend()
    if plat == "tpu":
      method = "approx"
    elif plat == "gpu" and scores.shape[-1] > (segment or max(4 * k, 2048)):
      method = "two_stage"
    else:
      method = "lax"
  if method == "approx":
    vals, idx = lax.approx_max_k(scores, k)
  elif method == "lax":
    vals, idx = lax.top_k(scores, k)
  elif method == "two_stage":
    vals, idx = _topk_two_stage(scores, k, segment or max(4 * k, 2048))
  else:
    raise ValueError(f"unknown method {method!r}")
  return vals, idx.astype(jnp.int32)


def _topk_two_stage(scores, k, segment):
  *lead, n = scores.shape
  if segment < k:
    raise ValueError(f"segment={segment} must be >= k={k}")
  if n <= segment:
    return lax.top_k(scores, k)
  nseg = common.cdiv(n, segment)
  x = scores
  if nseg * segment != n:
    pad = [(0, 0)] * len(lead) + [(0, nseg * segment - n)]
    x = jnp.pad(x, pad, constant_values=-jnp.inf)
  v1, i1 = lax.top_k(x.reshape(*lead, nseg, segment), k)
  i1 = i1 + (jnp.arange(nseg, dtype=i1.dtype) * segment)[:, None]
  v1 = v1.reshape(*lead, nseg * k)
  i1 = i1.reshape(*lead, nseg * k)
  vals, j = lax.top_k(v1, k)
  return vals, jnp.take_along_axis(i1, j, axis=-1)


def srh_scores_bytes(B, S_live, D, kv_head, T, itemsize=2):
  """HBM bytes the GPU path must move (keys of each distinct KV head read
  once, the f32 logits written and read back, the f32 scores written)."""
  nd = len(set(kv_head))
  n = len(kv_head)
  keys = B * nd * S_live * D * itemsize
  logits = 2 * B * n * T * S_live * 4
  return dict(keys=keys, logits=logits, scores=B * S_live * 4,
              total=keys + logits + B * S_live * 4)
