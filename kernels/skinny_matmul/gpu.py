"""Mosaic GPU kernel of ``skinny_matmul`` for Hopper (WGMMA, TMA).

One program per tile of ``tile_n`` output columns: the rows, padded to a
multiple of 64 (WGMMA's row operand), and the weight's column tile stream
through shared memory ``tile_k`` deep, ``stages`` copies in flight
(``plgpu.emit_pipeline``); the f32 accumulator stays in registers; the
epilogue scales each row, adds the bias and writes the tile once. The
padding rows cost tensor-core work only: at these row counts the kernel is
bound by the weight's bytes, not by its FLOPs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.common import round_up

ROWS = 64  # WGMMA's row operand: M is a multiple of 64 per warpgroup


def interpret_params():
  """Mosaic GPU's interpret mode (CPU tests); its parameters class is not
  public in every jax this package supports."""
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def _smem_transforms(cols: int, itemsize: int):
  """TMA / WGMMA tiling and swizzle of a shared-memory tile with rows of
  `cols` elements."""
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("tile_n", "tile_k", "stages", "interpret"))
def skinny_matmul_gpu(x, w, row_scale, bias, *, tile_n: int = 64, tile_k: int = 64,
                      stages: int = 4, interpret: bool = False) -> jax.Array:
  """``(x @ w) * row_scale[:, None] + bias`` (see ``reference.py``).

  x [M, K] and w [K, N] bf16 or f16; row_scale f32[M]; bias [N]. K must be a
  multiple of ``tile_k`` and N of ``tile_n`` (``ops.skinny_matmul`` says
  which tiles fit a shape).
  """
  m, k = x.shape
  n = w.shape[1]
  rows = round_up(m, ROWS)
  itemsize = jnp.dtype(x.dtype).itemsize
  x_transforms = _smem_transforms(tile_k, itemsize)
  w_transforms = _smem_transforms(tile_n, itemsize)

  def body(x_gmem, w_gmem, scale_gmem, bias_gmem, out_gmem):
    j = jax.lax.axis_index("n")
    cols = pl.ds(j * tile_n, tile_n)

    def epilogue_scope(scale_smem, bias_smem, barriers):
      # the epilogue's vectors load while the weight streams
      plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, barriers.at[0])
      plgpu.copy_gmem_to_smem(bias_gmem.at[cols], bias_smem, barriers.at[1])

      def accumulator_scope(acc):
        def step(_, x_smem, w_smem):
          plgpu.wgmma(acc, x_smem, w_smem)
          plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(k // tile_k,),
            in_specs=[plgpu.BlockSpec((rows, tile_k), lambda kk: (0, kk),
                                      transforms=x_transforms),
                      plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, j),
                                      transforms=w_transforms)],
            max_concurrent_steps=stages)(x_gmem, w_gmem)
        plgpu.barrier_wait(barriers.at[0])
        plgpu.barrier_wait(barriers.at[1])
        shape = (rows, tile_n)
        y = (acc[...] * jax.lax.broadcast_in_dim(scale_smem[...], shape, [0])
             + jax.lax.broadcast_in_dim(bias_smem[...], shape, [1]))
        out_gmem[:, cols] = y.astype(out_gmem.dtype)

      # register and shared-memory scratch are allocated in separate scopes
      pl.run_scoped(accumulator_scope, plgpu.ACC((rows, tile_n), jnp.float32))

    pl.run_scoped(epilogue_scope, plgpu.SMEM((rows,), jnp.float32),
                  plgpu.SMEM((tile_n,), jnp.float32), plgpu.Barrier(num_barriers=2))

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((rows, n), x.dtype), grid=(n // tile_n,),
      grid_names=("n",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({"interpret": interpret_params()} if interpret else {}))
  x_rows = jnp.pad(x, ((0, rows - m), (0, 0)))
  scale_rows = jnp.pad(row_scale.astype(jnp.float32), (0, rows - m))
  return kernel(x_rows, w, scale_rows, bias.astype(jnp.float32))[:m]
