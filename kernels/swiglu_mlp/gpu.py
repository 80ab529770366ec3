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

Everything is computed transposed: a WGMMA's first operand has 64 rows, its
second as few as 8 columns, so the weights (output features in rows,
`reference.stream_layout`) are the first operand and the N = 16..64 padded
activation rows the second. With the rows as the 64-row operand, 48 of every
64 rows of tensor-core work at a 16-row pass were padding.

Program p owns F block p (`reference.BLOCK` = 64 rows of F) and streams
row block p of the packed weights through `stages` shared-memory slots: a
TMA-only warpgroup fills them, a WGMMA warpgroup empties them.
  * steps 0 .. D/64 - 1: x^T[64 rows, :] ([64, N]) and one [gate^T ; up^T]
    tile [128, 64]: gate^T += W_gate^T x^T and up^T likewise, [64 F, N] f32
    each; after the last, h^T = silu(gate^T) * up^T goes to shared memory
    in x's dtype;
  * steps D/64 .. : one down^T tile [128 D, 64 F]: two WGMMAs (64 D rows
    each) of it with h^T, each [64, N] result stored through its own
    shared-memory slot by a TMA reduce-add into those rows of the f32
    output out^T [D, N] (in interpret mode, which has no TMA reductions,
    into program p's own partial, summed by XLA). The x tile of these steps
    is the last one again (read from L2; the pipeline's specs are per step).

The second operands, x^T (transposed by XLA before the call) and h^T, have
N, not K, as their contiguous axis; all operand tiles of a WGMMA share one
swizzle, so every tile's is N x itemsize bytes, and N a power of two >= 16
(a 32-byte swizzle at 16 rows).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.swiglu_mlp.reference import BLOCK, TILE_ROWS

MAX_ROWS = 64  # N of the WGMMAs: 16, 32 or 64 (a swizzle of 32, 64 or 128 bytes)
SMEM_BYTES = 227 * 1024


def interpret_params():
  """Mosaic GPU's interpret mode (CPU tests); its parameters class is not
  public in every jax this package supports."""
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def padded_rows(m: int) -> int:
  """N: the rows the kernel computes for m rows (see the module docstring)."""
  return max(16, pl.next_power_of_2(m))


def _transforms(swizzle: int, itemsize: int):
  """TMA / WGMMA tiling and swizzle of a shared-memory tile."""
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _store_transforms(cols: int):
  """Tiling and swizzle of an f32 tile with `cols` columns (TMA only)."""
  return _transforms(plgpu.find_swizzle(cols * 4 * 8), 4)


def smem_bytes(*, rows: int, itemsize: int, stages: int) -> int:
  """Shared memory of one program at N = `rows` (see the module docstring)."""
  return (stages * (rows * BLOCK + TILE_ROWS * BLOCK) * itemsize + BLOCK * rows * itemsize
          + 2 * BLOCK * rows * 4)


@functools.partial(jax.jit, static_argnames=("stages", "interpret"))
def swiglu_mlp_gpu(x, w_stream, residual, *, stages: int = 7, interpret: bool = False):
  """See ``reference.py`` for the contract; x and residual [N, D] with N =
  `padded_rows` (``ops.swiglu_mlp`` checks the shapes and pads the rows).
  Returns [N, D] f32."""
  n, d = x.shape
  programs = w_stream.shape[0]
  itemsize = jnp.dtype(x.dtype).itemsize
  operand = _transforms(n * itemsize, itemsize)
  gate_up_steps = d // BLOCK
  steps = gate_up_steps + d // TILE_ROWS

  def body(x_t_gmem, w_gmem, out_gmem):
    p = lax.axis_index("p")
    out_block = out_gmem.at[p] if interpret else out_gmem

    def scope(h_smem, out_smem):
      def compute_context(run_pipeline):
        def accumulators(acc_gate, acc_up):
          run_pipeline((acc_gate, acc_up))
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, plgpu.ACC((BLOCK, n), jnp.float32),
                      plgpu.ACC((BLOCK, n), jnp.float32))

      def step(idx, x_smem, w_smem, accs):  # x_smem: a [64 D, N] tile of x^T
        acc_gate, acc_up = accs
        s = idx[0]

        @pl.when(s < gate_up_steps)
        def _gate_up():
          plgpu.wgmma(acc_gate, w_smem.at[pl.ds(0, BLOCK)], x_smem)
          plgpu.wgmma(acc_up, w_smem.at[pl.ds(BLOCK, BLOCK)], x_smem)
          # the last step's two products are done: its slots go back to the
          # loads (delay_release=1) while this step's run
          plgpu.wgmma_wait(2)

        @pl.when(s == gate_up_steps - 1)
        def _swiglu():
          plgpu.wgmma_wait(0)
          gate = acc_gate[...]
          h_smem[...] = (gate * jax.nn.sigmoid(gate) * acc_up[...]).astype(h_smem.dtype)
          plgpu.commit_smem()

        @pl.when(s >= gate_up_steps)
        def _down():
          first = (s - gate_up_steps) * TILE_ROWS

          def rows(acc_lo, acc_hi):
            plgpu.wgmma(acc_lo, w_smem.at[pl.ds(0, BLOCK)], h_smem)
            plgpu.wgmma(acc_hi, w_smem.at[pl.ds(BLOCK, BLOCK)], h_smem)
            plgpu.wgmma_wait(0)
            for half, acc in enumerate((acc_lo, acc_hi)):
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
              out_smem[half] = acc[...]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[half],
                                      out_block.at[pl.ds(first + half * BLOCK, BLOCK)],
                                      reduction_op=None if interpret else "add")

          pl.run_scoped(rows, plgpu.ACC((BLOCK, n), jnp.float32),
                        plgpu.ACC((BLOCK, n), jnp.float32))

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((BLOCK, n), lambda s: (jnp.minimum(s, gate_up_steps - 1), 0),
                                    transforms=operand, delay_release=1),
                    plgpu.BlockSpec((TILE_ROWS, BLOCK), lambda s: (s, 0),
                                    transforms=operand, delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_t_gmem, w_gmem.at[p])

    pl.run_scoped(
        scope,
        plgpu.SMEM((BLOCK, n), x.dtype, transforms=operand),
        plgpu.SMEM((2, BLOCK, n), jnp.float32, transforms=_store_transforms(n)),
        collective_axes="wg")

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  if interpret:  # per-program partials of out^T
    partials = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, d, n), jnp.float32),
                            compiler_params=params, interpret=interpret_params(),
                            **mesh)(x.T, w_stream)
    return residual.astype(jnp.float32) + partials.sum(0).T
  # out^T, the residual's transposed f32 copy, is the buffer the programs add
  # into: a Ref argument of the kernel is aliased in and out
  out_t = jax.new_ref(residual.astype(jnp.float32).T)
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=params)(
      x.T, w_stream, out_t)
  return out_t[...].T
