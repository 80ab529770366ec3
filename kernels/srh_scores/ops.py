"""Public entry points: SRH importance scores and the top-k selection."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels import common


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
  from kernels.srh_scores.reference import check_srh_args
  kv_head = check_srh_args(q, k, kv_head, reduce)
  impl = common.resolve_impl(impl)
  if impl == "reference":
    from kernels.srh_scores.reference import srh_scores_reference
    return srh_scores_reference(q, k, lengths, kv_head, q_valid=q_valid,
                                reduce=reduce, scale=scale)
  if impl == "gpu":
    from kernels.srh_scores.gpu import srh_scores_gpu
    return srh_scores_gpu(q, k, lengths, kv_head, q_valid=q_valid,
                          reduce=reduce, scale=scale, interpret=interpret,
                          **tuning)
  from kernels.srh_scores.tpu import srh_scores_tpu
  return srh_scores_tpu(q, k, lengths, kv_head, q_valid=q_valid,
                        reduce=reduce, scale=scale, interpret=interpret,
                        **tuning)


def select_topk(scores, k) -> tuple[jax.Array, jax.Array]:
  """Top-k of scores along the last axis: (values, int32 indices).

  lax.top_k on GPU/CPU (exact); lax.approx_max_k on TPU (its fast path).
  """
  if common.backend() == "tpu":
    vals, idx = lax.approx_max_k(scores, k)
  else:
    vals, idx = lax.top_k(scores, k)
  return vals, idx.astype(jnp.int32)


def srh_scores_bytes(B, S_live, D, kv_head, T, itemsize=2):
  """HBM bytes the GPU path must move (keys of each distinct KV head read
  once, the f32 logits written and read back, the f32 scores written)."""
  nd = len(set(kv_head))
  n = len(kv_head)
  keys = B * nd * S_live * D * itemsize
  logits = 2 * B * n * T * S_live * 4
  return dict(keys=keys, logits=logits, scores=B * S_live * 4,
              total=keys + logits + B * S_live * 4)
