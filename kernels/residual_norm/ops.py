"""Public entry point of the fused residual add + RMSNorm."""
from __future__ import annotations

from kernels import common
from kernels.residual_norm.gpu import residual_norm_gpu
from kernels.residual_norm.reference import residual_norm_reference


def residual_norm(x, parts, weight, *, eps, impl="auto", interpret=False,
                  **tuning):
  """The sum of a projection's split-K partials added to the residual stream,
  then RMSNorm.

  Args:
    x: [..., d] the residual stream (bf16 or f32).
    parts: [S, ..., d] (f32) the S partial products of a projection, summed
      in f32 in the order s = 0, 1, ..., S - 1; or None (nothing to add).
    weight: [d] in x's dtype, the RMSNorm weight.
    eps: the RMSNorm epsilon.
    impl: "auto" (gpu on GPU, reference elsewhere), "reference", "gpu"
      (Pallas Triton), or "tpu", which runs the reference (no TPU kernel).
    interpret: Pallas interpret mode (CPU tests of the gpu kernel).
    **tuning: gpu: block_rows (rows per program, a power of two), num_warps.
      Ignored by the reference.
  Returns:
    (x_new, normed), both [..., d] in x's dtype: x_new = x + sum(parts) (x
    itself when parts is None) and normed = RMSNorm(x_new), as
    ``dustin_jax.models.decoder.RMSNorm`` computes it.
  """
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return residual_norm_gpu(x, parts, weight, eps=eps, interpret=interpret,
                             **tuning)
  return residual_norm_reference(x, parts, weight, eps=eps)
