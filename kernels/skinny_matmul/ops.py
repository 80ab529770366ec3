"""Public entry point of the skinny matmul with fused neighbours."""
from __future__ import annotations

from kernels import common
from kernels.skinny_matmul.gpu import skinny_matmul_gpu
from kernels.skinny_matmul.reference import skinny_matmul_reference


def skinny_matmul(x, w, *, norm_weight=None, eps=1e-6, bias=None, glu=False,
                  residual=None, impl="auto", interpret=False, **tuning):
  """``[residual +] act(norm(x) @ w [+ bias])`` for a few rows of x.

  Args:
    x: [M, K] activations (M small: a decode step's rows, <= 64).
    w: [K, N] weight in x's dtype.
    norm_weight: [K] or None: RMSNorm of x's rows first (eps: its epsilon).
    bias: [N] or None (not with glu).
    glu: w's columns alternate gate, up; the output is silu(gate) * up,
      [M, N // 2].
    residual: [M, N_out] or None: added to the output.
    impl: "auto" (gpu on GPU for M <= 64, reference elsewhere: more rows
      are a prefill's, XLA's GEMMs serve them), "reference", "gpu"
      (Pallas Triton), or "tpu", which runs the reference (XLA's own GEMM
      fusions serve a TPU's few-row projections).
    interpret: Pallas interpret mode (CPU tests of the gpu kernel).
    **tuning: gpu: block_n, block_k (powers of two >= 16), splits (K split
      over programs, plain products only), num_warps, num_stages.
  Returns:
    [M, N_out] in x's dtype.
  """
  if impl == "auto" and x.shape[0] > 64:
    impl = "reference"
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return skinny_matmul_gpu(x, w, norm_weight=norm_weight, eps=eps, bias=bias, glu=glu,
                             residual=residual, interpret=interpret, **tuning)
  return skinny_matmul_reference(x, w, norm_weight=norm_weight, eps=eps, bias=bias, glu=glu,
                                 residual=residual)
