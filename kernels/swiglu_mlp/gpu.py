"""Mosaic GPU kernel of ``swiglu_mlp`` for Hopper (TMA, WGMMA, warp
specialisation, TMA reductions).

Why: at a draft pass's 16 rows XLA runs a layer's MLP as three kernels (the
gate/up GEMM, silu * up, the down GEMM split over K) whose split partials the
next kernel sums with the residual; each is a few microseconds of launch,
first-tile latency and drain around ~1-4 us of weight bytes. Here one kernel
streams both matrices back to back, so the down matrix's tiles are in flight
while the gate/up product finishes, and the down products are summed into the
residual by the TMA unit (reduce-add stores into an f32 buffer that holds the
residual), not by another kernel.

Program p owns F block p (`reference.BLOCK` = 64 rows of F) and streams
row block p of the packed weights (`reference.stream_layout`) through
`stages` shared-memory slots: a TMA-only warpgroup fills them, a WGMMA
warpgroup empties them.
  * x [M, D] is copied once into shared memory: its M rows into the first M
    rows of a 64-row buffer, WGMMA's row operand. Rows M..63 are never
    written; an output row depends on its own x row only, and only the first
    M rows are stored.
  * steps 0 .. D/64 - 1: one [64 x (64 gate | 64 up)] tile each, two WGMMAs
    into the gate and up accumulators; after the last, h = silu(gate) * up
    of the block goes to shared memory in x's dtype.
  * steps D/64 .. : one [64 F rows x 128 D columns] tile of down each, one
    WGMMA h @ tile, stored through shared memory by a TMA reduce-add into
    those 128 columns of the f32 output (in interpret mode, which has no TMA
    reductions, into program p's own partial, summed by XLA).

Shared memory: 64 x D x itemsize (x) + stages x 64 x 128 x itemsize (the
weight slots) + 64 x 64 x itemsize (h) + 64 x 128 x 4 (the output tile) must
fit the SM's 227 KB: D <= 1024 with 4 stages.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS

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


def smem_bytes(d: int, *, itemsize: int, stages: int) -> int:
  """Shared memory of one program (see the module docstring)."""
  return (ROWS * d * itemsize + stages * BLOCK * TILE_COLS * itemsize + ROWS * BLOCK * itemsize
          + ROWS * TILE_COLS * 4)


@functools.partial(jax.jit, static_argnames=("stages", "interpret"))
def swiglu_mlp_gpu(x, w_stream, residual, *, stages: int = 4, interpret: bool = False):
  """See ``reference.py`` for the contract; ``ops.swiglu_mlp`` checks the
  shapes and pads the rows to a multiple of 8."""
  m, d = x.shape
  programs = w_stream.shape[0]
  itemsize = jnp.dtype(x.dtype).itemsize
  gate_up_steps = d // BLOCK
  steps = gate_up_steps + d // TILE_COLS

  def body(x_gmem, w_gmem, out_gmem):
    p = lax.axis_index("p")
    out_block = out_gmem.at[p] if interpret else out_gmem

    def scope(x_smem, h_smem, out_smem, ready):
      def compute_context(run_pipeline):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem.at[pl.ds(0, m)], ready.at[0])
        plgpu.barrier_wait(ready.at[0])

        def accumulators(acc_gate, acc_up):
          run_pipeline((acc_gate, acc_up))
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                      plgpu.ACC((ROWS, BLOCK), jnp.float32))

      def step(idx, w_smem, accs):
        acc_gate, acc_up = accs
        s = idx[0]

        @pl.when(s < gate_up_steps)
        def _gate_up():
          a = x_smem.at[:, pl.ds(s * BLOCK, BLOCK)]
          plgpu.wgmma(acc_gate, a, w_smem.at[:, pl.ds(0, BLOCK)])
          plgpu.wgmma(acc_up, a, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
          plgpu.wgmma_wait(0)  # the slot goes back to the loads when this returns

        @pl.when(s == gate_up_steps - 1)
        def _swiglu():
          gate = acc_gate[...]
          h_smem[...] = (gate * jax.nn.sigmoid(gate) * acc_up[...]).astype(h_smem.dtype)
          plgpu.commit_smem()

        @pl.when(s >= gate_up_steps)
        def _down():
          def columns(acc):
            plgpu.wgmma(acc, h_smem, w_smem)
            plgpu.wgmma_wait(0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read out_smem
            out_smem[...] = acc[...]
            plgpu.commit_smem()
            cols = pl.ds((s - gate_up_steps) * TILE_COLS, TILE_COLS)
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, m)], out_block.at[:, cols],
                                    reduction_op=None if interpret else "add")

          pl.run_scoped(columns, plgpu.ACC((ROWS, TILE_COLS), jnp.float32))

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((BLOCK, TILE_COLS), lambda s: (s, 0),
                                    transforms=_transforms(BLOCK, itemsize))],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(w_gmem.at[p])

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, d), x.dtype, transforms=_transforms(BLOCK, itemsize)),
        plgpu.SMEM((ROWS, BLOCK), x.dtype, transforms=_transforms(BLOCK, itemsize)),
        plgpu.SMEM((ROWS, TILE_COLS), jnp.float32, transforms=_transforms(TILE_COLS, 4)),
        plgpu.Barrier(num_barriers=1),
        collective_axes="wg")

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg",
              compiler_params=plgpu.CompilerParams(
                  lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  if interpret:
    partials = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, m, d), jnp.float32),
                            interpret=interpret_params(), **mesh)(x, w_stream)
    return residual.astype(jnp.float32) + partials.sum(0)
  # the residual's f32 copy is the buffer the programs add into: a Ref
  # argument of the kernel is aliased in and out
  out = jax.new_ref(residual.astype(jnp.float32))
  compiler_params = mesh.pop("compiler_params")
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh),
            compiler_params=compiler_params)(x, w_stream, out)
  return out[...]
