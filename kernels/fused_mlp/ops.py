"""Public entry point: a SwiGLU MLP of a few rows in one kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.fused_mlp.gpu import default_tuning, fused_mlp_gpu
from kernels.fused_mlp.reference import fused_mlp_reference


def check_shapes(x, w_gate_up, w_down, tune: dict) -> None:
  """One message for every shape the kernel cannot take."""
  if x.ndim != 2 or w_gate_up.ndim != 2 or w_down.ndim != 2:
    raise ValueError(f"fused_mlp: x {x.shape}, w_gate_up {w_gate_up.shape} and w_down "
                     f"{w_down.shape} must be matrices")
  m, d = x.shape
  f = w_down.shape[0]
  if w_gate_up.shape != (d, 2 * f) or w_down.shape != (f, d):
    raise ValueError(f"fused_mlp: w_gate_up must be [D, 2F] = {(d, 2 * f)} and w_down [F, D] "
                     f"= {(f, d)} for x [M, D={d}]; got {w_gate_up.shape}, {w_down.shape}")
  if not x.dtype == w_gate_up.dtype == w_down.dtype:
    raise ValueError(f"fused_mlp: x and the weights must share a dtype, got {x.dtype}, "
                     f"{w_gate_up.dtype}, {w_down.dtype}")
  splits, bk, bd = tune["splits"], tune["block_k"], tune["block_d"]
  if f % splits or (f // splits) % 16 or (f // splits) & (f // splits - 1):
    raise ValueError(f"fused_mlp: F={f} / splits={splits} must be a power of two >= 16")
  if d % bk or d % bd:
    raise ValueError(f"fused_mlp: D={d} must be a multiple of block_k={bk} and block_d={bd}")
  if m > 64:
    raise ValueError(f"fused_mlp serves a few rows (<= 64), got M={m}")


def fused_mlp(x, w_gate_up, w_down, *, impl="auto", interpret=False, **tuning) -> jax.Array:
  """The MLP's down projection as f32 partial products [splits, M, D]; their
  sum over the leading axis is down(SiLU(gate) x up) (see
  ``reference.fused_mlp_reference``).

  Args:
    x: [M, D] normed rows, M <= 64.
    w_gate_up: [D, 2F], gate/up columns in pairs (column 2j gate_j, 2j + 1
      up_j).
    w_down: [F, D].
    impl: "auto" (gpu on GPU, reference elsewhere), "reference", "gpu"
      (Pallas Triton), or "tpu", which runs the reference.
    interpret: Pallas interpret mode (CPU tests of the gpu kernel).
    **tuning: splits (programs, one slice of F each), block_k, block_d,
      num_warps, num_stages (``gpu.default_tuning``); the reference takes
      splits alone.
  """
  unknown = sorted(tuning.keys() - default_tuning(1, 1).keys())
  if unknown:
    raise ValueError(f"fused_mlp: unknown tuning {unknown}; known: "
                     f"{sorted(default_tuning(1, 1))}")
  tune = default_tuning(x.shape[-1], w_down.shape[0]) | {
      k: v for k, v in tuning.items() if v is not None}
  check_shapes(x, w_gate_up, w_down, tune)
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return fused_mlp_gpu(x, w_gate_up, w_down, interpret=interpret, **tune)
  return fused_mlp_reference(x, w_gate_up, w_down, tune["splits"])


def fused_mlp_sum(x, w_gate_up, w_down, **kwargs) -> jax.Array:
  """The MLP's output [M, D] in x's dtype: `fused_mlp`'s partials summed
  (inside a model, where the residual add reads them, XLA fuses the sum
  into that add)."""
  return fused_mlp(x, w_gate_up, w_down, **kwargs).sum(0).astype(x.dtype)
