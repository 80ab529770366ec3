"""Public entry point of sparse verify attention."""
from __future__ import annotations

import jax

from kernels import common
from kernels.sparse_verify.gpu import sparse_verify_gpu
from kernels.sparse_verify.reference import sparse_verify_reference
from kernels.sparse_verify.tpu import sparse_verify_tpu


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
