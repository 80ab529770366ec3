"""Public entry point: exact top-k of each row, in ascending index order."""
from __future__ import annotations

import jax

from kernels import common
from kernels.topk.gpu import topk_gpu
from kernels.topk.reference import topk_reference


def topk(scores, k, *, impl="auto", interpret=False, **tuning
         ) -> tuple[jax.Array, jax.Array]:
  """The k largest entries of each row, ties to the lower index.

  Args:
    scores: [B, S] floating point (cast to f32; masked entries -inf).
    k: static int, 1 <= k <= S.
    impl: "auto" (gpu on GPU, reference elsewhere), "reference", "gpu"
      (Pallas Triton), or "tpu", which runs the reference (no TPU kernel).
    interpret: Pallas interpret mode (CPU tests of the gpu kernel).
    **tuning: gpu: block, chunk, radix_bits, num_warps, num_stages
      (``kernels.topk.gpu.topk_gpu``).  Ignored by the reference.
  Returns:
    (values f32[B, k], indices int32[B, k]), each row in ascending index
    order (not by value): the set lax.top_k selects, bit for bit (-0.0 <
    +0.0; rows with fewer than k finite values take their lowest-indexed
    -inf entries).
  """
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return topk_gpu(scores, k, interpret=interpret, **tuning)
  return topk_reference(scores, k)
