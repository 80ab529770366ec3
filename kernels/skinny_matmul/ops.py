"""Public entry point: a projection of a few rows with its epilogue fused."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.skinny_matmul.gpu import skinny_matmul_gpu
from kernels.skinny_matmul.reference import skinny_matmul_reference


def check_tiles(x, w, tile_n: int, tile_k: int) -> None:
  """One message for every shape the kernel cannot take."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"skinny_matmul: x {x.shape} @ w {w.shape} is not a matrix product")
  if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"skinny_matmul: x and w must both be bf16 or f16, got {x.dtype} and "
                     f"{w.dtype}")
  k, n = w.shape
  if k % tile_k or n % tile_n:
    raise ValueError(f"skinny_matmul: K={k} must be a multiple of tile_k={tile_k} and N={n} "
                     f"of tile_n={tile_n}")


def skinny_matmul(x, w, row_scale=None, bias=None, *, impl: str = "reference",
                  interpret: bool = False, tile_n: int = 64, tile_k: int = 64,
                  stages: int = 4) -> jax.Array:
  """``(x @ w) * row_scale[:, None] + bias`` in x's dtype (f32 accumulation).

  Args:
    x: [M, K] activation rows (bf16 / f16 for the kernel).
    w: [K, N] weight, x's dtype.
    row_scale: optional f32[M].
    bias: optional [N].
    impl: "reference" (XLA; the default: the kernel has no measured win
      yet) or "gpu" (the Mosaic GPU kernel; Hopper, or CPU with
      ``interpret=True``).
    interpret: Mosaic GPU interpret mode (CPU tests of the kernel).
    tile_n, tile_k, stages: the kernel's output-column tile, the depth of a
      streamed tile and the tiles in flight.
  """
  if impl == "reference":
    return skinny_matmul_reference(x, w, row_scale, bias)
  if impl != "gpu":
    raise ValueError(f"skinny_matmul: unknown impl {impl!r} (reference, gpu)")
  check_tiles(x, w, tile_n, tile_k)
  m, n = x.shape[0], w.shape[1]
  row_scale = jnp.ones((m,), jnp.float32) if row_scale is None else row_scale
  bias = jnp.zeros((n,), jnp.float32) if bias is None else bias
  return skinny_matmul_gpu(x, w, row_scale, bias, tile_n=tile_n, tile_k=tile_k, stages=stages,
                           interpret=interpret)
