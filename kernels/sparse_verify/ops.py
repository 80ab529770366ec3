"""Public entry point of sparse verify attention."""
from __future__ import annotations

import jax

from kernels import common
from kernels.sparse_verify.gpu import sparse_verify_gpu
from kernels.sparse_verify.reference import (sparse_verify_packed_reference,
                                             sparse_verify_reference)
from kernels.sparse_verify.tpu import sparse_verify_tpu
from kernels.window_attention.gpu import listed_attention_gpu


def sparse_verify(q, k, v, lengths, indices, *, scale=None, impl="auto",
                  interpret=False, **tuning) -> jax.Array:
  """Verify attention over the selected context rows plus the new block.

  Args:
    q: [B, T, Hq, D]; k, v: [B, Hkv, S, D] (the T block rows already written
      at lengths[b] .. lengths[b] + T - 1); lengths: int32[B].
    indices: int32[B, K] context positions (each < lengths[b], duplicate
      free, -1 = padding), shared by every KV head and verify query.
    scale: softmax scale, default 1/sqrt(D).
    impl: "auto" | "reference" | "gpu" | "tpu"; interpret: Pallas interpret.
    **tuning: gpu: block_k, splits, num_warps, num_stages; tpu: block_k,
      splits.
  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  impl = common.resolve_impl(impl)
  if impl == "reference":
    return sparse_verify_reference(q, k, v, lengths, indices, scale=scale)
  if impl == "gpu":
    return sparse_verify_gpu(q, k, v, lengths, indices, scale=scale,
                             interpret=interpret, **tuning)
  return sparse_verify_tpu(q, k, v, lengths, indices, scale=scale,
                           interpret=interpret, **tuning)


def sparse_verify_packed(qkv, k_cache, v_cache, lengths, indices, cos, sin, *,
                         scale=None, impl="auto", interpret=False, **tuning):
  """A verify layer's attention from its packed q/k/v projection: RoPE, both
  cache writes and sparse verify attention, one kernel on GPU.

  Args:
    qkv: [B, T, Hkv, G + 2, D], q, k_new and v_new packed per KV head (the
      layout of `kernels.window_attention.ops.window_attention`), before RoPE.
    k_cache, v_cache: [B, Hkv, S, D], qkv's dtype; lengths: int32[B], the new
      rows go to lengths[b] .. lengths[b] + T - 1, all < S.
    indices: int32[B, K] as in `sparse_verify`.
    cos, sin: [B, T, D // 2] f32 RoPE tables of the new positions.
    impl: "auto" | "reference" | "gpu" (the Pallas Triton kernel of
      `kernels.window_attention.gpu` with an index list) | "tpu" (RoPE and
      the writes in XLA, then the TPU sparse_verify kernel).
    **tuning: gpu: block_w (index block rows), splits, num_warps, num_stages,
      prefetch, unroll; tpu: as sparse_verify.
  Returns:
    (out [B, T, Hq, D], k_cache, v_cache) with the roped k rows and the v
    rows written (in place on GPU when the caches are donated).
  """
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return listed_attention_gpu(qkv, k_cache, v_cache, lengths, cos, sin,
                                indices, scale=scale, interpret=interpret,
                                **tuning)
  attend = None
  if impl == "tpu":
    attend = lambda *a, scale: sparse_verify_tpu(*a, scale=scale,
                                                 interpret=interpret, **tuning)
  return sparse_verify_packed_reference(qkv, k_cache, v_cache, lengths,
                                        indices, cos, sin, scale=scale,
                                        attend=attend)
