"""Mosaic GPU kernel of ``stream_matmul`` for Hopper (TMA, WGMMA, warp
specialisation).

Why: at 16 rows a projection moves its weight once and does almost no
arithmetic, so its time is the weight's bytes over the bytes the GPU keeps
in flight. XLA's GEMMs and a Pallas Triton kernel issue a tile's loads and
wait for them in the warps that multiply (results/h200/README.md: 12-57% of
the copy bandwidth for the 0.5B draft's projections at 16 rows). Here one
warpgroup only issues TMA copies of weight tiles into `stages` shared-memory
slots and another only multiplies, so `stages` tiles stay in flight while
the multiplies run.

Program (j, s) of the grid (N / tile_w, splits) owns weight column block j
(tile_w = tile_n columns, or 2 tile_n with swiglu) over K slice s:
  * x[:, K slice] is copied once into shared memory: its M rows into the
    first M rows of a 64-row buffer, WGMMA's row operand. Rows M..63 are
    never written; an output row depends on its own x row only, and only
    the first M rows are stored.
  * the weight block streams in tiles of tile_k rows through the pipeline
    (``plgpu.emit_pipeline_warp_specialized``); each tile is one WGMMA into
    the f32 accumulator (two with swiglu: the gate and the up half of the
    tile into their own accumulators).
  * the epilogue (+ bias, or silu(gate) * up with swiglu) goes through
    shared memory to one TMA store of the M rows; with splits > 1 the f32
    partial product of the slice is stored instead, for the consumer to sum.

Shared memory: 64 x K/splits x itemsize (x) + stages x tile_k x tile_w x
itemsize (the weight slots) + 64 x tile_n x 2 or 4 (the output tile) must
fit the SM's 227 KB.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # WGMMA's row operand per warpgroup
SMEM_BYTES = 227 * 1024


def interpret_params():
  """Mosaic GPU's interpret mode (CPU tests); its parameters class is not
  public in every jax this package supports."""
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def _transforms(cols: int, itemsize: int):
  """TMA / WGMMA tiling and swizzle of a shared-memory tile whose rows hold
  `cols` elements."""
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(k: int, *, itemsize: int, tile_n: int, tile_k: int, stages: int,
               swiglu: bool, splits: int) -> int:
  """Shared memory of one program (see the module docstring)."""
  tile_w = 2 * tile_n if swiglu else tile_n
  out_itemsize = 4 if splits > 1 else itemsize
  return (ROWS * (k // splits) * itemsize + stages * tile_k * tile_w * itemsize
          + ROWS * tile_n * out_itemsize)


@functools.partial(jax.jit, static_argnames=("swiglu", "splits", "tile_n", "tile_k", "stages",
                                             "interpret"))
def stream_matmul_gpu(x, w, bias=None, *, swiglu: bool = False, splits: int = 1,
                      tile_n: int = 64, tile_k: int = 64, stages: int = 4,
                      interpret: bool = False) -> jax.Array:
  """See ``reference.py`` for the contract (the swiglu block is tile_n; a
  bias only with a plain product); ``ops.stream_matmul`` checks the shapes."""
  m, k = x.shape
  n = w.shape[1]
  itemsize = jnp.dtype(x.dtype).itemsize
  tile_w = 2 * tile_n if swiglu else tile_n
  k_slice = k // splits
  if splits > 1:
    out_type = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
  else:
    out_type = jax.ShapeDtypeStruct((m, n // 2 if swiglu else n), x.dtype)
  out_dtype = out_type.dtype

  def body(x_gmem, w_gmem, *refs):
    bias_gmem, out_gmem = refs if bias is not None else (None, refs[0])
    j = lax.axis_index("n")
    s = lax.axis_index("s")
    k_cols = pl.ds(s * k_slice, k_slice)
    out_block = out_gmem.at[s] if splits > 1 else out_gmem

    def scope(x_smem, out_smem, bias_smem, ready):
      def compute_context(run_pipeline):
        plgpu.copy_gmem_to_smem(x_gmem.at[:, k_cols], x_smem.at[pl.ds(0, m)], ready.at[0])
        if bias is not None:
          plgpu.copy_gmem_to_smem(bias_gmem.at[pl.ds(j * tile_n, tile_n)], bias_smem,
                                  ready.at[1])
          plgpu.barrier_wait(ready.at[1])
        plgpu.barrier_wait(ready.at[0])

        def accumulators(acc, acc_up):
          run_pipeline((acc, acc_up))
          y = acc[...]
          if swiglu:
            y = y * jax.nn.sigmoid(y) * acc_up[...]
          if bias is not None:
            y = y + lax.broadcast_in_dim(bias_smem[...].astype(jnp.float32), y.shape, [1])
          out_smem[...] = y.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, m)],
                                  out_block.at[:, pl.ds(j * tile_n, tile_n)])
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, plgpu.ACC((ROWS, tile_n), jnp.float32),
                      plgpu.ACC((ROWS, tile_n), jnp.float32) if swiglu else None)

      def multiply(idx, w_smem, accs):
        acc, acc_up = accs
        a = x_smem.at[:, pl.ds(idx[0] * tile_k, tile_k)]
        if swiglu:
          plgpu.wgmma(acc, a, w_smem.at[:, pl.ds(0, tile_n)])
          plgpu.wgmma(acc_up, a, w_smem.at[:, pl.ds(tile_n, tile_n)])
        else:
          plgpu.wgmma(acc, a, w_smem)
        plgpu.wgmma_wait(0)  # the slot goes back to the loads when this returns
        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          multiply, grid=(k_slice // tile_k,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((tile_k, tile_w), lambda kk: (kk, 0),
                                    transforms=_transforms(tile_n, itemsize))],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(w_gmem.at[k_cols, pl.ds(j * tile_w, tile_w)])

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, k_slice), x.dtype, transforms=_transforms(tile_k, itemsize)),
        plgpu.SMEM((ROWS, tile_n), out_dtype,
                   transforms=_transforms(tile_n, jnp.dtype(out_dtype).itemsize)),
        plgpu.SMEM((tile_n,), x.dtype) if bias is not None else None,
        plgpu.Barrier(num_barriers=2),
        collective_axes="wg")

  kernel = plgpu.kernel(
      body, out_type=out_type, grid=(n // tile_w, splits), grid_names=("n", "s"),
      num_threads=2, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **({"interpret": interpret_params()} if interpret else {}))
  return kernel(x, w) if bias is None else kernel(x, w, bias)
