"""Public entry points: a projection of a few rows with its epilogue fused,
and its f32 partial products over slices of K."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.skinny_matmul.gpu import skinny_matmul_gpu, skinny_matmul_partials_gpu
from kernels.skinny_matmul.reference import (skinny_matmul_partials_reference,
                                             skinny_matmul_reference)


def check_tiles(x, w, tile_n: int, tile_k: int, splits: int = 1) -> None:
  """One message for every shape the kernel cannot take."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"skinny_matmul: x {x.shape} @ w {w.shape} is not a matrix product")
  if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"skinny_matmul: x and w must both be bf16 or f16, got {x.dtype} and "
                     f"{w.dtype}")
  k, n = w.shape
  if k % (tile_k * splits) or n % tile_n:
    raise ValueError(f"skinny_matmul: K={k} must be a multiple of splits x tile_k = {splits} x "
                     f"{tile_k} and N={n} of tile_n={tile_n}")


def _check_impl(impl: str) -> None:
  if impl not in ("reference", "gpu"):
    raise ValueError(f"skinny_matmul: unknown impl {impl!r} (reference, gpu)")


def skinny_matmul(x, w, row_scale=None, bias=None, *, impl: str = "reference",
                  interpret: bool = False, tile_n: int = 64, tile_k: int = 64,
                  stages: int = 4, splits: int = 1) -> jax.Array:
  """``(x @ w) * row_scale[:, None] + bias`` in x's dtype (f32 accumulation).

  Args:
    x: [M, K] activation rows (bf16 / f16 for the kernel).
    w: [K, N] weight, x's dtype.
    row_scale: optional f32[M].
    bias: optional [N].
    impl: "reference" (XLA; the default) or "gpu" (the Mosaic GPU kernel;
      Hopper, or CPU with ``interpret=True``).
    interpret: Mosaic GPU interpret mode (CPU tests of the kernel).
    tile_n, tile_k, stages: the kernel's output-column tile, the depth of a
      streamed tile and the tiles in flight.
    splits: K in this many slices, one program each per column tile; their
      f32 partial products are summed (and the epilogue applied) by XLA.
  """
  _check_impl(impl)
  if impl == "reference":
    return skinny_matmul_reference(x, w, row_scale, bias)
  check_tiles(x, w, tile_n, tile_k, splits)
  m, n = x.shape[0], w.shape[1]
  if splits > 1:
    y = skinny_matmul_partials_gpu(x, w, splits=splits, tile_n=tile_n, tile_k=tile_k,
                                   stages=stages, interpret=interpret).sum(0)
    if row_scale is not None:
      y = y * row_scale.astype(jnp.float32)[:, None]
    if bias is not None:
      y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
  row_scale = jnp.ones((m,), jnp.float32) if row_scale is None else row_scale
  bias = jnp.zeros((n,), jnp.float32) if bias is None else bias
  return skinny_matmul_gpu(x, w, row_scale, bias, tile_n=tile_n, tile_k=tile_k, stages=stages,
                           interpret=interpret)


def skinny_matmul_partials(x, w, *, splits: int, impl: str = "reference",
                           interpret: bool = False, tile_n: int = 64, tile_k: int = 64,
                           stages: int = 4) -> jax.Array:
  """f32 [splits, M, N]: x @ w over `splits` equal slices of K, for a
  consumer to sum where it reads the product (one kernel fewer)."""
  _check_impl(impl)
  if impl == "reference":
    return skinny_matmul_partials_reference(x, w, splits)
  check_tiles(x, w, tile_n, tile_k, splits)
  return skinny_matmul_partials_gpu(x, w, splits=splits, tile_n=tile_n, tile_k=tile_k,
                                    stages=stages, interpret=interpret)
