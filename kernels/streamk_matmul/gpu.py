"""Mosaic GPU kernel of ``streamk_matmul`` for Hopper (TMA, WGMMA, warp
specialisation, TMA reductions).

Why: a GEMM of a few rows is bound by its weight's bytes, and one SM streams
about its 1/132 share of the copy bandwidth, so the weight must be spread over
every SM in equal parts. Output tiles of 128 columns with K whole do not
spread evenly (the 7B's down projection has 28 of them), and a split over K
leaves partial products that another kernel sums. Here the units of work
(output tile, K step of 64 rows) are split into one contiguous run per SM
(`reference.Schedule`, "stream-K"): each program streams the same number of
weight tiles, and the sum over each output tile it touches goes into the f32
output by a TMA reduce-add store (the output buffer holds `acc` on entry).

A program's pipeline (`plgpu.emit_pipeline_warp_specialized`): a TMA-only
warpgroup fills `stages` shared-memory slots with the x tile [64 or 128
rows, 64] and the weight tile [64, 128] of each step; a WGMMA warpgroup
multiplies them into one [64, 128] f32 accumulator per 64 rows of x (x's
rows past M arrive as zeros from TMA). When a run reaches the last K step of
an output tile, or its own end, the accumulators go through shared memory to
a reduce-add into that tile's columns and start again from zero. In
interpret mode, which has neither TMA reductions nor stores into an
accumulator, program p writes its running sum at the end of the j-th tile it
touches to its own slot j instead, and XLA adds the slots' differences in.

Shared memory: stages x (rows x 64 + 64 x 128) x itemsize + 2 x 64 x 128 x 4
(the output slots); 4 stages at 128 rows, 6 at 64.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.streamk_matmul.reference import TILE_K, TILE_N, Schedule
from kernels.swiglu_mlp.gpu import SMEM_BYTES, interpret_params

ROWS = 64  # WGMMA's row operand per warpgroup
MAX_ROWS = 2 * ROWS


def _transforms(cols: int, itemsize: int):
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def row_blocks(m: int) -> int:
  return -(-m // ROWS)


def smem_bytes(m: int, *, itemsize: int, stages: int, out_slots: int = 2) -> int:
  return (stages * (row_blocks(m) * ROWS * TILE_K + TILE_K * TILE_N) * itemsize
          + out_slots * ROWS * TILE_N * 4)


def default_stages(m: int, itemsize: int) -> int:
  """The most weight slots that fit, at most 6."""
  for stages in range(6, 1, -1):
    if smem_bytes(m, itemsize=itemsize, stages=stages) <= SMEM_BYTES - 4096:
      return stages
  return 1


@functools.partial(jax.jit, static_argnames=("programs", "stages", "out_slots", "interpret"))
def streamk_matmul_gpu(x, w, acc, *, programs: int, stages: int, out_slots: int = 2,
                       interpret: bool = False):
  """``acc + x @ w`` in f32; ``ops.streamk_matmul`` checks the shapes and
  pads the rows to a multiple of 8."""
  m, k = x.shape
  n = w.shape[1]
  sched = Schedule.of(k, n, programs)
  blocks = row_blocks(m)
  itemsize = jnp.dtype(x.dtype).itemsize
  slots = max(len(sched.tiles_of(p)) for p in range(sched.programs))

  def body(x_gmem, w_gmem, out_gmem):
    p = lax.axis_index("p")

    def unit(s):  # the run's last unit again past its end (a load, no product)
      return sched.start(p) + jnp.minimum(s, sched.count(p) - 1)

    def scope(out_smem):
      def compute_context(run_pipeline):
        def accumulators(*accs):
          run_pipeline(accs)
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, *[plgpu.ACC((ROWS, TILE_N), jnp.float32)
                                      for _ in range(blocks)])

      def step(idx, x_smem, w_smem, accs):
        s = idx[0]
        live = s < sched.count(p)
        u = unit(s)
        tile = u // sched.k_steps

        @pl.when(live)
        def _product():
          for b, a in enumerate(accs):
            plgpu.wgmma(a, x_smem.at[pl.ds(b * ROWS, ROWS)], w_smem)
          # the previous step's products are done: its slots go back to the
          # loads (delay_release=1) while this step's run
          plgpu.wgmma_wait(blocks)

        @pl.when(live & ((u % sched.k_steps == sched.k_steps - 1)
                         | (s == sched.count(p) - 1)))
        def _store():
          plgpu.wgmma_wait(0)
          if interpret:
            dst = out_gmem.at[p, tile - sched.start(p) // sched.k_steps]
          else:
            dst = out_gmem.at[:, pl.ds(tile * TILE_N, TILE_N)]
          for b, a in enumerate(accs):
            rows = min(ROWS, m - b * ROWS)
            # this slot's last store has read it
            plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
            out_smem[b % out_slots] = a[...]
            if not interpret:  # (interpret mode cannot store into an accumulator)
              a[...] = jnp.zeros((ROWS, TILE_N), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[b % out_slots, pl.ds(0, rows)],
                                    dst.at[pl.ds(b * ROWS, rows)],
                                    reduction_op=None if interpret else "add")

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(sched.steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((blocks * ROWS, TILE_K),
                                    lambda s: (0, unit(s) % sched.k_steps),
                                    transforms=_transforms(TILE_K, itemsize), delay_release=1),
                    plgpu.BlockSpec((TILE_K, TILE_N),
                                    lambda s: (unit(s) % sched.k_steps, unit(s) // sched.k_steps),
                                    transforms=_transforms(TILE_N, itemsize), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_gmem, w_gmem)

    pl.run_scoped(scope,
                  plgpu.SMEM((out_slots, ROWS, TILE_N), jnp.float32,
                             transforms=_transforms(TILE_N, 4)),
                  collective_axes="wg")

  mesh = dict(grid=(sched.programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  if interpret:  # x's rows past M as explicit zeros; each program's tiles in its own slots
    x = jnp.pad(x, ((0, blocks * ROWS - m), (0, 0)))
    parts = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((sched.programs, slots, m, TILE_N), jnp.float32),
        compiler_params=params, interpret=interpret_params(), **mesh)(x, w)
    # the accumulators are never reset here: slot j holds the run's sum up to
    # its j-th tile, so a tile's own sum is the difference of two slots
    parts = parts - jnp.pad(parts[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
    tile_of = np.full((sched.programs, slots), sched.n_tiles)  # unused slots: dropped
    for q in range(sched.programs):
      tiles = sched.tiles_of(q)
      tile_of[q, :len(tiles)] = tiles
    tiles = jnp.zeros((sched.n_tiles, m, TILE_N), jnp.float32).at[tile_of.reshape(-1)].add(
        parts.reshape(-1, m, TILE_N), mode="drop")
    return acc.astype(jnp.float32) + jnp.moveaxis(tiles, 0, 1).reshape(m, n)
  # acc's f32 copy is the buffer the programs add into: a Ref argument of the
  # kernel is aliased in and out
  out = jax.new_ref(acc.astype(jnp.float32))
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=params)(x, w, out)
  return out[...]


TILE_N_T = 4 * ROWS  # output rows of a tile of the transposed form


@functools.partial(jax.jit, static_argnames=("programs", "stages", "interpret"))
def streamk_matmul_t_gpu(x_t, w_t, acc_t, *, programs: int, stages: int,
                         interpret: bool = False):
  """The transposed form: ``acc_t + w_t @ x_t`` in f32 for x_t [K, M], w_t
  [N, K], acc_t [N, M] (M a multiple of 8, at most 256). The weight is
  WGMMA's 64-row operand and the M rows are its N, so M needs no padding to
  64 and a tile of 256 output columns takes 4 accumulators of [64, M]: each
  x tile is read once per 256 weight columns instead of once per 128."""
  m, k = x_t.shape
  n = w_t.shape[0]
  sched = Schedule.of(k, n, programs, tile_n=TILE_N_T)
  blocks = TILE_N_T // ROWS
  itemsize = jnp.dtype(x_t.dtype).itemsize
  slots = max(len(sched.tiles_of(p)) for p in range(sched.programs))

  def body(x_gmem, w_gmem, out_gmem):
    p = lax.axis_index("p")

    def unit(s):
      return sched.start(p) + jnp.minimum(s, sched.count(p) - 1)

    def scope(out_smem):
      def compute_context(run_pipeline):
        def accumulators(*accs):
          run_pipeline(accs)
          plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, *[plgpu.ACC((ROWS, m), jnp.float32) for _ in range(blocks)])

      def step(idx, x_smem, w_smem, accs):
        s = idx[0]
        live = s < sched.count(p)
        u = unit(s)
        tile = u // sched.k_steps

        @pl.when(live)
        def _product():
          for b, a in enumerate(accs):
            plgpu.wgmma(a, w_smem.at[pl.ds(b * ROWS, ROWS)], plgpu.transpose_ref(x_smem, (1, 0)))
          plgpu.wgmma_wait(blocks)

        @pl.when(live & ((u % sched.k_steps == sched.k_steps - 1)
                         | (s == sched.count(p) - 1)))
        def _store():
          plgpu.wgmma_wait(0)
          for b, a in enumerate(accs):
            if interpret:
              dst = out_gmem.at[p, tile - sched.start(p) // sched.k_steps, pl.ds(b * ROWS, ROWS)]
            else:
              dst = out_gmem.at[pl.ds(tile * TILE_N_T + b * ROWS, ROWS)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[b % 2] = a[...]
            if not interpret:
              a[...] = jnp.zeros((ROWS, m), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[b % 2], dst,
                                    reduction_op=None if interpret else "add")

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(sched.steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((m, TILE_K), lambda s: (0, unit(s) % sched.k_steps),
                                    transforms=_transforms(TILE_K, itemsize), delay_release=1),
                    plgpu.BlockSpec((TILE_N_T, TILE_K),
                                    lambda s: (unit(s) // sched.k_steps, unit(s) % sched.k_steps),
                                    transforms=_transforms(TILE_K, itemsize), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(x_gmem, w_gmem)

    pl.run_scoped(scope, plgpu.SMEM((2, ROWS, m), jnp.float32, transforms=_transforms(m, 4)),
                  collective_axes="wg")

  mesh = dict(grid=(sched.programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  if interpret:
    parts = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((sched.programs, slots, TILE_N_T, m), jnp.float32),
        compiler_params=params, interpret=interpret_params(), **mesh)(x_t, w_t)
    parts = parts - jnp.pad(parts[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
    tile_of = np.full((sched.programs, slots), sched.n_tiles)
    for q in range(sched.programs):
      tiles = sched.tiles_of(q)
      tile_of[q, :len(tiles)] = tiles
    tiles = jnp.zeros((sched.n_tiles, TILE_N_T, m), jnp.float32).at[tile_of.reshape(-1)].add(
        parts.reshape(-1, TILE_N_T, m), mode="drop")
    return acc_t.astype(jnp.float32) + tiles.reshape(n, m)
  out = jax.new_ref(acc_t.astype(jnp.float32))
  pl.kernel(body, out_type=(), mesh=plgpu.Mesh(**mesh), compiler_params=params)(x_t, w_t, out)
  return out[...]
