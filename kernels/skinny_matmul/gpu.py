"""Mosaic GPU kernel of ``skinny_matmul`` for Hopper (WGMMA, TMA).

One program per tile of ``tile_n`` output columns and slice of K (``splits``
slices): the rows, padded to a multiple of 64 (WGMMA's row operand), and the
weight's column tile stream through shared memory ``tile_k`` deep, ``stages``
copies in flight (``plgpu.emit_pipeline``); the f32 accumulator stays in
registers. With one slice the epilogue scales each row, adds the bias and
writes the tile once. With several, each program writes its f32 partial
product and the consumer sums them: the skinny projections of a small model
(N = 896 columns: 14 tiles) need K split to give the GPU's 132 SMs work,
and a sum over a few partials fuses into the elementwise kernel that reads
the projection anyway. The padding rows cost tensor-core work only: at
these row counts the kernel is bound by the weight's bytes, not its FLOPs.
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


def _pipelined_product(acc, x_gmem, w_gmem, *, rows, k_steps, k_first, j, tile_n, tile_k,
                       stages, itemsize):
  """acc += x[:, K slice] @ w[K slice, column tile j], the K slice being
  `k_steps` tiles from tile `k_first`, streamed through shared memory."""
  def step(_, x_smem, w_smem):
    plgpu.wgmma(acc, x_smem, w_smem)
    plgpu.wgmma_wait(0)

  plgpu.emit_pipeline(
      step, grid=(k_steps,),
      in_specs=[plgpu.BlockSpec((rows, tile_k), lambda kk: (0, k_first + kk),
                                transforms=_smem_transforms(tile_k, itemsize)),
                plgpu.BlockSpec((tile_k, tile_n), lambda kk: (k_first + kk, j),
                                transforms=_smem_transforms(tile_n, itemsize))],
      max_concurrent_steps=stages)(x_gmem, w_gmem)


def _kernel(body, out_type, grid, grid_names, interpret):
  return plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=grid_names,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({"interpret": interpret_params()} if interpret else {}))


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

  def body(x_gmem, w_gmem, scale_gmem, bias_gmem, out_gmem):
    j = jax.lax.axis_index("n")
    cols = pl.ds(j * tile_n, tile_n)

    def epilogue_scope(scale_smem, bias_smem, barriers):
      # the epilogue's vectors load while the weight streams
      plgpu.copy_gmem_to_smem(scale_gmem, scale_smem, barriers.at[0])
      plgpu.copy_gmem_to_smem(bias_gmem.at[cols], bias_smem, barriers.at[1])

      def accumulator_scope(acc):
        _pipelined_product(acc, x_gmem, w_gmem, rows=rows, k_steps=k // tile_k, k_first=0,
                           j=j, tile_n=tile_n, tile_k=tile_k, stages=stages,
                           itemsize=itemsize)
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

  kernel = _kernel(body, jax.ShapeDtypeStruct((rows, n), x.dtype), (n // tile_n,), ("n",),
                   interpret)
  x_rows = jnp.pad(x, ((0, rows - m), (0, 0)))
  scale_rows = jnp.pad(row_scale.astype(jnp.float32), (0, rows - m))
  return kernel(x_rows, w, scale_rows, bias.astype(jnp.float32))[:m]


@functools.partial(jax.jit, static_argnames=("splits", "tile_n", "tile_k", "stages",
                                             "interpret"))
def skinny_matmul_partials_gpu(x, w, *, splits: int, tile_n: int = 64, tile_k: int = 64,
                               stages: int = 4, interpret: bool = False) -> jax.Array:
  """f32 partial products [splits, M, N] of x [M, K] @ w [K, N] over
  `splits` equal slices of K (their sum is the product). K must be a
  multiple of ``splits * tile_k`` and N of ``tile_n``."""
  m, k = x.shape
  n = w.shape[1]
  rows = round_up(m, ROWS)
  k_steps = k // (tile_k * splits)

  def body(x_gmem, w_gmem, out_gmem):
    j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")

    def accumulator_scope(acc):
      _pipelined_product(acc, x_gmem, w_gmem, rows=rows, k_steps=k_steps, k_first=s * k_steps,
                         j=j, tile_n=tile_n, tile_k=tile_k, stages=stages,
                         itemsize=jnp.dtype(x.dtype).itemsize)
      out_gmem.at[s][:, pl.ds(j * tile_n, tile_n)] = acc[...]

    pl.run_scoped(accumulator_scope, plgpu.ACC((rows, tile_n), jnp.float32))

  kernel = _kernel(body, jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
                   (n // tile_n, splits), ("n", "s"), interpret)
  return kernel(jnp.pad(x, ((0, rows - m), (0, 0))), w)[:, :m]
