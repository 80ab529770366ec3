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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS

ROWS = 64  # WGMMA's row operand per warpgroup
STAGES = 6  # weight slots in flight (see the module docstring)
SMEM_BYTES = 227 * 1024
PREFETCH_COLS = 128  # a prefetched array is viewed as rows of this many elements
PREFETCH_ROWS = 256  # rows per L2 prefetch (TMA's largest box side)


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


@functools.partial(jax.jit, static_argnames=("stages", "interpret"))
def swiglu_mlp_gpu(x, w_stream, residual, prefetch=(), *, stages: int = STAGES,
                   interpret: bool = False):
  """See ``reference.py`` for the contract; ``ops.swiglu_mlp`` checks the
  shapes and pads the rows to a multiple of 8. Returns [M, D] f32.

  `prefetch`: [N, PREFETCH_COLS] arrays (the next layer's weights) that the
  programs send to L2 as they start, spread over them, so that the kernels
  which read them after this one find them there (not in interpret mode,
  which has no prefetches). They are hints: no value depends on them. They
  go out before the program's own loads (results/h200/README.md, "The next
  layer's weights in L2")."""
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
        def _gate_up():
          plgpu.wgmma(acc_gate, x_smem, w_smem.at[:, pl.ds(0, BLOCK)])
          plgpu.wgmma(acc_up, x_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
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
                                    transforms=_transforms(BLOCK, itemsize), delay_release=1),
                    plgpu.BlockSpec((BLOCK, TILE_COLS),
                                    lambda s: (jnp.where(s < gate_up_steps, s,
                                                         gate_up_steps + down_tile(s)), 0),
                                    transforms=_transforms(BLOCK, itemsize), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_gmem, w_gmem.at[p])

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, BLOCK), x.dtype, transforms=_transforms(BLOCK, itemsize)),
        plgpu.SMEM((2, ROWS, BLOCK), jnp.float32, transforms=_transforms(BLOCK, 4)),
        collective_axes="wg")

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
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


# ------------------------------------------------------- over every SM
# The kernel above runs one program per F block: 76 programs at the 0.5B's
# F = 4864, which leave 56 of 132 SMs idle while each program streams its
# 344 KB at the ~32 GB/s one program sustains. `swiglu_mlp_grid_gpu` spreads
# the same tiles over one program per SM in two phases that meet at a grid
# barrier:
#   A: the gate/up tiles as units (F block f, D tile k), F-block-major, cut
#      into `programs` contiguous runs; a program sums its units of one F
#      block in its accumulators and reduce-adds the sums into the f32
#      gate/up buffer `gu` [M, 2F] (block f at columns f*128: 64 gate, 64 up);
#   barrier: each program signals once its reduce-adds are complete and waits
#      until every program has (a GMEM semaphore at GPU scope);
#   B: the down tiles as units (F block f, D column tile c), F-block-major,
#      cut the same way; per F block a program loads that block's gate/up
#      sums, forms h = silu(gate) * up in x's dtype and reduce-adds h @ tile
#      into the f32 residual, one column tile per unit.
# The memory warpgroup streams the phase-B tiles while the programs wait at
# the barrier: weights do not depend on the gate/up sums. `gu` starts at zero:
# each program zeroes a share of it as it starts and signals a second
# semaphore, which every program awaits before its first reduce-add (several
# microseconds later, so the wait finds it done).
# The semaphores need every program resident at once: `programs` must not
# exceed the SMs, and the shared memory (about 200 KB) holds one program per
# SM. In interpret mode, which has neither GMEM semaphores (jax 0.10.2) nor
# TMA reductions, the phases run as two kernels and each run of sums goes to
# a slot of its own, added up by XLA.

GRID_STAGES = 4  # weight slots in flight; 2 gate/up buffers take the room of more


def grid_schedule(f: int, d: int, programs: int) -> dict:
  """The static cut of both phases' units into `programs` runs (see above):
  unit counts, each program's first unit, and the most F blocks (A) or
  units (B) one program's run holds, which size the interpret-mode slots."""
  nb, kt, ct = f // BLOCK, d // BLOCK, d // TILE_COLS
  units_a, units_b = nb * kt, nb * ct
  a_lo = [p * units_a // programs for p in range(programs + 1)]
  b_lo = [p * units_b // programs for p in range(programs + 1)]
  n_a = [a_lo[p + 1] - a_lo[p] for p in range(programs)]
  n_b = [b_lo[p + 1] - b_lo[p] for p in range(programs)]
  a_blocks = [((a_lo[p + 1] - 1) // kt - a_lo[p] // kt + 1) if n_a[p] else 0
              for p in range(programs)]
  return dict(nb=nb, kt=kt, ct=ct, units_a=units_a, units_b=units_b, a_lo=a_lo, b_lo=b_lo,
              steps=max(x + y for x, y in zip(n_a, n_b)), a_slots=max(a_blocks),
              b_slots=max(n_b))


def grid_smem_bytes(*, itemsize: int, stages: int) -> int:
  """Shared memory of one program of `swiglu_mlp_grid_gpu`."""
  return (stages * (ROWS * BLOCK + BLOCK * TILE_COLS) * itemsize + ROWS * BLOCK * itemsize
          + 2 * ROWS * TILE_COLS * 4 + 2 * ROWS * BLOCK * 4)


def _grid_call(x, w_stream, gu, prefetch, *, m, programs, stages, phases, interpret):
  """One kernel running `phases` ("ab": both, with the barrier; "a" or "b":
  one, interpret mode). Compiled, `gu` and the output are Refs the programs
  reduce-add into; interpreted, phase A returns the runs' sums per slot
  [P, a_slots, M, 128] and phase B its products per unit [P, b_slots, M, 128]
  (`gu` then holds phase A's summed result). `m`: x's rows that count (x
  may hold more, zeros)."""
  d = x.shape[1]
  f = w_stream.shape[0] * BLOCK
  sch = grid_schedule(f, d, programs)
  nb, kt, ct, a_slots = sch["nb"], sch["kt"], sch["ct"], sch["a_slots"]
  units_a, units_b = sch["units_a"], sch["units_b"]
  itemsize = jnp.dtype(x.dtype).itemsize
  do_a, do_b, sync = "a" in phases, "b" in phases, phases == "ab"
  steps = sch["steps"] if sync else (max(sch["a_lo"][p + 1] - sch["a_lo"][p]
                                         for p in range(programs)) if do_a else sch["b_slots"])
  w_tiles = w_stream.reshape(-1, TILE_COLS)  # tile (f, s): row block f * (kt + ct) + s

  def body(x_gmem, w_gmem, *refs):
    if interpret:
      gu_in = refs[0] if do_b else None
      out_gmem = refs[-1]
      prefetch_refs = ()
    else:
      *prefetch_refs, out_gmem, gu_gmem = refs
      gu_in = gu_gmem
    p = lax.axis_index("p")
    if prefetch_refs:
      @pl.when(lax.axis_index("wg") == 0)
      def _prefetch():
        _prefetch_to_l2(prefetch_refs, p, programs)
    a_lo, a_hi = p * units_a // programs, (p + 1) * units_a // programs
    b_lo, b_hi = p * units_b // programs, (p + 1) * units_b // programs
    n_a = (a_hi - a_lo) if do_a else jnp.int32(0)
    n_b = b_hi - b_lo
    f_a0, f_b0, f_b_last = a_lo // kt, b_lo // ct, (b_hi - 1) // ct
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((2,))) if sync else None

    def unit_a(s):  # (F block, D tile) of gate/up step s
      u = jnp.minimum(a_lo + s, units_a - 1)
      return u // kt, u % kt

    def unit_b(s):  # (F block, column tile) of down step s
      v = jnp.clip(b_lo + s - n_a, 0, units_b - 1)
      return v // ct, v % ct

    def w_block(s):
      fa, k = unit_a(jnp.minimum(s, jnp.maximum(n_a - 1, 0)))
      fb, c = unit_b(s)
      return jnp.where(s < n_a, fa * (kt + ct) + k, fb * (kt + ct) + kt + c)

    def scope(gu_smem, h_smem, out_smem, bars):
      def store_halves(accs, dests, op):
        for half, (acc, dest) in enumerate(zip(accs, dests)):
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
          out_smem[half] = acc[...]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(out_smem.at[half, pl.ds(0, m)], dest, reduction_op=op)

      def load_gate_up(block, buf):
        plgpu.copy_gmem_to_smem(gu_in.at[:, pl.ds(block * TILE_COLS, TILE_COLS)],
                                gu_smem.at[buf, pl.ds(0, m)], bars.at[buf])

      def compute_context(run_pipeline):
        if sync:  # this program's share of gu zeroed, then announced
          for half in range(2):
            out_smem[half] = jnp.zeros((ROWS, BLOCK), jnp.float32)
          plgpu.commit_smem()

          @pl.loop(p, nb, step=programs)
          def _zero(block):
            for half in range(2):
              plgpu.copy_smem_to_gmem(out_smem.at[half, pl.ds(0, m)],
                                      gu_gmem.at[:, pl.ds(block * TILE_COLS + half * BLOCK,
                                                          BLOCK)])
          plgpu.wait_smem_to_gmem(0)
          plgpu.semaphore_signal(sems.at[0], 1, memory_scope="gpu")
        def accumulators(*accs):
          run_pipeline(accs)
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators,
                      *[plgpu.ACC((ROWS, BLOCK), jnp.float32) for _ in range(2 * a_slots)])

      def step(idx, x_smem, w_smem, accs):
        s = idx[0]
        fa, k = unit_a(s)
        is_a = s < n_a
        run = fa - f_a0  # each run of F block sums has an accumulator pair of its own
        pairs = [accs[2 * r:2 * r + 2] for r in range(a_slots)]
        for r, (acc_gate, acc_up) in enumerate(pairs):
          @pl.when(is_a & (run == r))
          def _gate_up():
            plgpu.wgmma(acc_gate, x_smem, w_smem.at[:, pl.ds(0, BLOCK)])
            plgpu.wgmma(acc_up, x_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
            plgpu.wgmma_wait(2)

          @pl.when(is_a & (run == r) & ((k == kt - 1) | (s == n_a - 1)))
          def _flush_gate_up():  # the run's sums of F block fa
            plgpu.wgmma_wait(0)
            if sync:
              @pl.when(s == jnp.minimum(kt - 1 - a_lo % kt, n_a - 1))
              def _zeroed():  # the first reduce-add waits until gu is zero everywhere
                plgpu.semaphore_wait(sems.at[0], programs, decrement=False, memory_scope="gpu")
            if interpret:
              dests = [out_gmem.at[p, run, :, pl.ds(h * BLOCK, BLOCK)] for h in range(2)]
            else:
              dests = [gu_gmem.at[:, pl.ds(fa * TILE_COLS + h * BLOCK, BLOCK)] for h in range(2)]
            store_halves((acc_gate, acc_up), dests, None if interpret else "add")

        if sync:
          @pl.when(s == jnp.maximum(n_a - 1, 0))
          def _arrive():  # this program's reduce-adds into gu are complete
            plgpu.wait_smem_to_gmem(0)
            plgpu.semaphore_signal(sems.at[1], 1, memory_scope="gpu")

        if not do_b:
          return accs
        j = s - n_a
        fb, c = unit_b(s)
        is_b = (j >= 0) & (j < n_b)
        buf = (fb - f_b0) % 2

        @pl.when(is_b & (j == 0))
        def _first_down_step():
          if sync:
            plgpu.semaphore_wait(sems.at[1], programs, decrement=False, memory_scope="gpu")
          load_gate_up(f_b0, 0)

          @pl.when(f_b0 + 1 <= f_b_last)
          def _second():
            load_gate_up(f_b0 + 1, 1)

        @pl.when(is_b & ((j == 0) | (c == 0)))
        def _swiglu():  # h of F block fb, from its gate/up sums
          plgpu.barrier_wait(bars.at[buf])
          plgpu.wgmma_wait(0)
          gate = gu_smem[buf, :, pl.ds(0, BLOCK)]
          h_smem[...] = (gate * jax.nn.sigmoid(gate)
                         * gu_smem[buf, :, pl.ds(BLOCK, BLOCK)]).astype(h_smem.dtype)
          plgpu.commit_smem()

          @pl.when(fb + 2 <= f_b_last)
          def _next():
            load_gate_up(fb + 2, buf)

        @pl.when(is_b)
        def _down():
          def columns(acc_lo, acc_hi):
            plgpu.wgmma(acc_lo, h_smem, w_smem.at[:, pl.ds(0, BLOCK)])
            plgpu.wgmma(acc_hi, h_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
            plgpu.wgmma_wait(0)
            if interpret:
              dests = [out_gmem.at[p, j, :, pl.ds(h * BLOCK, BLOCK)] for h in range(2)]
            else:
              dests = [out_gmem.at[:, pl.ds(c * TILE_COLS + h * BLOCK, BLOCK)]
                       for h in range(2)]
            store_halves((acc_lo, acc_hi), dests, None if interpret else "add")

          pl.run_scoped(columns, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                        plgpu.ACC((ROWS, BLOCK), jnp.float32))

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((ROWS, BLOCK),
                                    lambda s: (0, unit_a(jnp.minimum(
                                        s, jnp.maximum(n_a - 1, 0)))[1]),
                                    transforms=_transforms(BLOCK, itemsize), delay_release=1),
                    plgpu.BlockSpec((BLOCK, TILE_COLS), lambda s: (w_block(s), 0),
                                    transforms=_transforms(TILE_COLS, itemsize),
                                    delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_gmem, w_gmem)

    pl.run_scoped(
        scope,
        plgpu.SMEM((2, ROWS, TILE_COLS), jnp.float32, transforms=_transforms(TILE_COLS, 4)),
        plgpu.SMEM((ROWS, BLOCK), x.dtype, transforms=_transforms(BLOCK, itemsize)),
        plgpu.SMEM((2, ROWS, BLOCK), jnp.float32, transforms=_transforms(BLOCK, 4)),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        collective_axes="wg")

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  if interpret:
    slots = sch["a_slots"] if phases == "a" else sch["b_slots"]
    out_type = jax.ShapeDtypeStruct((programs, slots, m, TILE_COLS), jnp.float32)
    args = (x, w_tiles) + ((gu,) if do_b else ())
    return plgpu.kernel(body, out_type=out_type, compiler_params=params,
                        interpret=interpret_params(), **mesh)(*args)
  # gu is the call's own output (no initialisation: the programs zero it)
  pl.kernel(body, out_type=jax.ShapeDtypeStruct((m, 2 * f), jnp.float32),
            mesh=plgpu.Mesh(**mesh), compiler_params=params)(x, w_tiles, *prefetch, gu)


def _interpret_sums(parts, m, d, f, programs, phase):
  """Phase `phase`'s slots added up where they belong: gate/up [M, 2F] (A)
  or the down products [M, D] (B)."""
  sch = grid_schedule(f, d, programs)
  kt, ct = sch["kt"], sch["ct"]
  lo = sch["a_lo"] if phase == "a" else sch["b_lo"]
  slots, tiles = [], []
  for p in range(programs):
    if phase == "a":
      first = lo[p] // kt
      blocks = range(first, (lo[p + 1] - 1) // kt + 1) if lo[p + 1] > lo[p] else ()
      slots += [(p, b - first) for b in blocks]
      tiles += list(blocks)
    else:
      units = range(lo[p], lo[p + 1])
      slots += [(p, v - lo[p]) for v in units]
      tiles += [v % ct for v in units]
  n_tiles = sch["nb"] if phase == "a" else ct
  rows = parts[np.array([s[0] for s in slots]), np.array([s[1] for s in slots])]
  total = jnp.zeros((n_tiles, m, TILE_COLS), jnp.float32).at[np.array(tiles)].add(rows)
  return total.transpose(1, 0, 2).reshape(m, n_tiles * TILE_COLS)


@functools.partial(jax.jit, static_argnames=("programs", "stages", "interpret"))
def swiglu_mlp_grid_gpu(x, w_stream, residual, prefetch=(), *, programs: int,
                        stages: int = GRID_STAGES, interpret: bool = False):
  """``swiglu_mlp_gpu``'s contract, over `programs` programs (at most one per
  SM) in two phases with a grid barrier (see the comment above)."""
  m, d = x.shape
  f = w_stream.shape[0] * BLOCK
  if interpret:  # the phases as two kernels (see above)
    x = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    common = dict(m=m, programs=programs, stages=stages, interpret=True)
    parts = _grid_call(x, w_stream, None, (), phases="a", **common)
    gu = _interpret_sums(parts, m, d, f, programs, "a")
    parts = _grid_call(x, w_stream, gu, (), phases="b", **common)
    return residual.astype(jnp.float32) + _interpret_sums(parts, m, d, f, programs, "b")
  out = jax.new_ref(residual.astype(jnp.float32))
  _grid_call(x, w_stream, out, tuple(prefetch), m=m, programs=programs, stages=stages,
             phases="ab", interpret=False)
  return out[...]
