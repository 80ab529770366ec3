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
warpgroup empties them. A program's time is its ~344 KB (0.5B) over the
bytes it keeps in flight, so shared memory goes to weight slots: x comes
tile by tile beside them, as WGMMA's 64-row operand read from the M rows of
x (TMA fills the rows past M with zeros; an output row depends on its own x
row only, and only the first M rows are stored).
  * steps 0 .. D/64 - 1: x[:, 64 columns] and one [64 x (64 gate | 64 up)]
    tile, two WGMMAs into the gate and up accumulators; after the last,
    h = silu(gate) * up of the block goes to shared memory in x's dtype;
  * steps D/64 .. : one [64 F rows x 128 D columns] tile of down, two
    WGMMAs h @ tile (64 columns each), each half stored through its own
    shared-memory slot by a TMA reduce-add into those columns of the f32
    output (in interpret mode, which has no TMA reductions, into program
    p's own partial, summed by XLA). Program p takes the down tiles from
    column tile p (mod D/128) on, so that the programs, which reach their
    down steps together, add into different columns at a time. The x tile
    of these steps is the last one again (read from L2; the pipeline's
    specs are per step).

Shared memory: stages x (64 x 64 + 64 x 128) x itemsize (x and weight
slots) + 64 x 64 x itemsize (h) + 2 x 64 x 64 x 4 (the output slots) must
fit the SM's 227 KB: up to 7 stages at bf16. The down products are
h @ tile although 64 - M of their rows are padding: computed transposed
(tile^T @ h^T, [64 D, M], h through a transposed view) the kernel takes
11.2 against 12.7 us at the 0.5B's 16 rows, but its f32 output and
residual are then [D, M], and the transposes XLA runs around it cost the
step 0.2 ms at 32k x 16 (results/h200/README.md, "The transposed down
products in the step"). `STAGES` = 6 is the default: on an H200, 6
slots run the 0.5B's MLP at 16 rows in 12.1-12.4 us against 12.5-12.7 us
with 7, and the 1B's in 33.7-33.8 against 34.2-34.3 us
(results/h200/README.md, "six weight slots").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.mosaic_common import SMEM_BYTES, compiler_params, phase, tiled
from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS

ROWS = 64  # WGMMA's row operand per warpgroup
STAGES = 6  # weight slots in flight (see the module docstring)
PREFETCH_COLS = 128  # a prefetched array is viewed as rows of this many elements
PREFETCH_ROWS = 256  # rows per L2 prefetch (TMA's largest box side)


def interpret_params():
  """Mosaic GPU's interpret mode (CPU tests); its parameters class is not
  public in every jax this package supports."""
  params = getattr(plgpu, "InterpretParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def smem_bytes(*, itemsize: int, stages: int) -> int:
  """Shared memory of one program (see the module docstring)."""
  return (stages * (ROWS * BLOCK + BLOCK * TILE_COLS) * itemsize + ROWS * BLOCK * itemsize
          + 2 * ROWS * BLOCK * 4)


def prefetch_boxes(n: int, programs: int, p):
  """The first rows of program p's prefetch boxes over an array of n rows,
  and the box's row count (<= PREFETCH_ROWS): about n / programs rows a
  program, the last boxes clamped to end at the array's end."""
  rows = pl.cdiv(n, programs)
  boxes = pl.cdiv(rows, PREFETCH_ROWS)
  box = min(pl.cdiv(rows, boxes), n)
  return [jnp.minimum(p * rows + i * box, n - box) for i in range(boxes)], box


def _prefetch_to_l2(refs, p, programs: int):
  """Program p's share of each [N, PREFETCH_COLS] array in `refs`, sent to
  L2 by TMA prefetches: hints that change no value, and that the program
  does not wait for."""
  for ref in refs:
    starts, box = prefetch_boxes(ref.shape[0], programs, p)
    for start in starts:
      plgpu.async_prefetch(ref.at[pl.ds(start, box)])


@functools.partial(jax.jit, static_argnames=("stages", "interpret", "profile_dir"))
def swiglu_mlp_gpu(x, w_stream, residual, prefetch=(), *, stages: int = STAGES,
                   interpret: bool = False, profile_dir: str = ""):
  """See ``reference.py`` for the contract; ``ops.swiglu_mlp`` checks the
  shapes and pads the rows to a multiple of 8. Returns [M, D] f32.

  `prefetch`: [N, PREFETCH_COLS] arrays (the next layer's weights) that the
  programs send to L2 as they start, spread over them, so that the kernels
  which read them after this one find them there (not in interpret mode,
  which has no prefetches). They are hints: no value depends on them. They
  go out before the program's own loads (results/h200/README.md, "The next
  layer's weights in L2").

  `profile_dir`: where each call writes a trace of the compute warpgroups'
  regions "gate_up", "swiglu" and "down" (Mosaic GPU's in-kernel profiler;
  not in interpret mode); empty: no profiling."""
  m, d = x.shape
  programs = w_stream.shape[0]
  itemsize = jnp.dtype(x.dtype).itemsize
  gate_up_steps = d // BLOCK
  down_steps = d // TILE_COLS
  steps = gate_up_steps + down_steps
  prefetch = () if interpret else tuple(prefetch)

  def body(x_gmem, w_gmem, *refs):
    *prefetch_refs, out_gmem = refs
    p = lax.axis_index("p")
    if prefetch_refs:
      @pl.when(lax.axis_index("wg") == 0)
      def _prefetch():
        _prefetch_to_l2(prefetch_refs, p, programs)

    def down_tile(s):  # program p's down steps from column tile p on
      return (s - gate_up_steps + p) % down_steps
    out_block = out_gmem.at[p] if interpret else out_gmem

    def scope(h_smem, out_smem):
      def compute_context(run_pipeline):
        def accumulators(acc_gate, acc_up):
          run_pipeline((acc_gate, acc_up))
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                      plgpu.ACC((ROWS, BLOCK), jnp.float32))

      def step(idx, x_smem, w_smem, accs):
        acc_gate, acc_up = accs
        s = idx[0]

        @pl.when(s < gate_up_steps)
        @phase("gate_up")
        def _gate_up():
          plgpu.wgmma(acc_gate, x_smem, w_smem.at[:, pl.ds(0, BLOCK)])
          plgpu.wgmma(acc_up, x_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
          # the last step's two products are done: its slots go back to the
          # loads (delay_release=1) while this step's run
          plgpu.wgmma_wait(2)

        @pl.when(s == gate_up_steps - 1)
        @phase("swiglu")
        def _swiglu():
          plgpu.wgmma_wait(0)
          gate = acc_gate[...]
          h_smem[...] = (gate * jax.nn.sigmoid(gate) * acc_up[...]).astype(h_smem.dtype)
          plgpu.commit_smem()

        @pl.when(s >= gate_up_steps)
        @phase("down")
        def _down():
          first = down_tile(s) * TILE_COLS

          def columns(acc_lo, acc_hi):
            plgpu.wgmma(acc_lo, h_smem, w_smem.at[:, pl.ds(0, BLOCK)])
            plgpu.wgmma(acc_hi, h_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
            plgpu.wgmma_wait(0)
            for half, acc in enumerate((acc_lo, acc_hi)):
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
              out_smem[half] = acc[...]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[half, pl.ds(0, m)],
                                      out_block.at[:, pl.ds(first + half * BLOCK, BLOCK)],
                                      reduction_op=None if interpret else "add")

          pl.run_scoped(columns, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                        plgpu.ACC((ROWS, BLOCK), jnp.float32))

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((ROWS, BLOCK),
                                    lambda s: (0, jnp.minimum(s, gate_up_steps - 1)),
                                    transforms=tiled(BLOCK, itemsize), delay_release=1),
                    plgpu.BlockSpec((BLOCK, TILE_COLS),
                                    lambda s: (jnp.where(s < gate_up_steps, s,
                                                         gate_up_steps + down_tile(s)), 0),
                                    transforms=tiled(BLOCK, itemsize), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_gmem, w_gmem.at[p])

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, BLOCK), x.dtype, transforms=tiled(BLOCK, itemsize)),
        plgpu.SMEM((2, ROWS, BLOCK), jnp.float32, transforms=tiled(BLOCK, 4)),
        collective_axes="wg")

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  # a program's compute warpgroup enters one region per step and the SwiGLU's
  params = compiler_params("" if interpret else profile_dir, regions=64)
  if interpret:  # the x rows past M as explicit zeros, and per-program partials
    x = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    partials = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((programs, m, d), jnp.float32),
                            compiler_params=params, interpret=interpret_params(),
                            **mesh)(x, w_stream)
    return residual.astype(jnp.float32) + partials.sum(0)
  # the residual's f32 copy is the buffer the programs add into: a Ref
  # argument of the kernel is aliased in and out
  out = jax.new_ref(residual.astype(jnp.float32))
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=params)(
      x, w_stream, *prefetch, out)
  return out[...]
