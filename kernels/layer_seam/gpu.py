"""Mosaic GPU kernel of ``layer_seam`` for Hopper: one resident kernel in
three phases met at grid barriers (TMA, WGMMA, warp specialisation, TMA
reduce-adds, GMEM semaphores).

Why: at a draft pass's 16 rows the work between two attentions (o, the
residual, the norm, the MLP, the residual, the next q/k/v) is six kernels
of ~1.4-13 us, each bound by its launch and first loads rather than by its
bytes (~30 MB, ~7 us at the copy bandwidth). Here one kernel keeps a
program on each SM: a memory warpgroup streams the program's weight blocks
through a ring of shared-memory slots from the kernel's start and across
the phases (weights do not depend on activations), a compute warpgroup
multiplies, and a phase that needs every program's output of the phase
before waits at a grid barrier (a GMEM semaphore each producer signals once
its stores have landed): ~1.4 us where a kernel boundary costs ~3 us
(results/h200/README.md, "A persistent draft layer").

Rows (tokens) are WGMMA's 64-row operand, as in `kernels.swiglu_mlp`: the
Mp real rows are loaded, the rest of a tile is never stored. Programs, for
the 0.5B draft (D 896, A 896, F 4864, Nq 1152):
  * phase 1, o (programs F/64 .. F/64 + D/64 - 1, one per 64 output
    columns c): x_mid = r + attn @ o over A/128 blocks (attn read whole at
    the start); stores x_mid into r (f32) and as bf16 into xb, and
    reduce-adds its rows' sums of squares over its 64 columns into ss
    (each row's sum repeated along ss's 64 columns). Signals barrier 0.
  * phase 2, the MLP (programs 0 .. F/64 - 1, F block p, as
    `kernels.swiglu_mlp`): waits barrier 0, reads xb and ss; gate and up
    products scaled by the norm's row scale rsqrt(ss / D + eps) (the norm
    weights are folded into gate/up); down products reduce-added into r,
    which then holds r'. Signals barrier 1. These programs also zero the
    q/k/v output as they start.
  * phase 3, the next layer's q/k/v (tile p = n * D/64 + k, one per
    program): waits barrier 1, rounds r's columns 64k .. 64k + 63 to bf16
    and reduce-adds their product into q/k/v. The last program zeroes ss
    for the next call.
A program's blocks of all three phases are one stream (`reference`'s
layout), so its first MLP or q/k/v blocks are in shared memory before its
barrier opens.

Constraints: all programs resident at once (a barrier waiting on a program
not yet started would never open): `programs` <= the SM count, one program
per SM by its shared memory. GMEM semaphores start at zero at each call
(an XLA fill before the kernel). There is no interpret mode (no GMEM
semaphores, no TMA reductions there): `ops` runs the reference instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.layer_seam.reference import BLOCK, COLS, SeamDims
from kernels.mosaic_common import SMEM_BYTES, compiler_params, phase, tiled

ROWS = 64  # WGMMA's row operand: the Mp rows and padding
MAX_STAGES = 10  # weight blocks in flight per program, at most (what shared memory leaves)


def programs_needed(dims: SeamDims, has_next: bool = True) -> int:
  return max(dims.mlp_programs + dims.owners, dims.qkv_tiles if has_next else 0)


def activation_rows(dims: SeamDims, mp: int) -> int:
  """Rows of the shared-memory buffer that holds attn's or xb's 64-column
  tiles: tile k is rows k * Mp .. k * Mp + 63. Only its first Mp rows are
  loaded; the rest overlap the next tiles, whose values reach only product
  rows that are never stored (a product row depends on its own row only),
  so the tiles take Mp rows each instead of 64."""
  return (max(dims.a, dims.d) // BLOCK - 1) * mp + ROWS


def smem_bytes(dims: SeamDims, mp: int, stages: int, itemsize: int = 2) -> int:
  """Shared memory of one program: the weight slots, the activation tiles,
  h, two f32 tiles."""
  return ((stages * BLOCK * COLS + (activation_rows(dims, mp) + ROWS) * BLOCK) * itemsize
          + 2 * ROWS * BLOCK * 4)


def default_stages(dims: SeamDims, mp: int) -> int:
  """The most weight slots shared memory leaves (at most MAX_STAGES)."""
  stages = MAX_STAGES
  while stages > 2 and smem_bytes(dims, mp, stages) > SMEM_BYTES - 1024:
    stages -= 1
  return stages


def fits(dims: SeamDims, mp: int, stages: int | None = None, sms: int = 132) -> bool:
  stages = stages or default_stages(dims, mp)
  return (mp % 8 == 0 and 8 <= mp <= ROWS and programs_needed(dims) <= sms
          and dims.nq // BLOCK <= dims.mlp_programs
          and smem_bytes(dims, mp, stages) <= SMEM_BYTES - 1024)


@functools.partial(jax.jit, static_argnames=("dims", "has_next", "eps", "programs", "stages",
                                             "profile_dir"))
def layer_seam_gpu(attn, stream, r, xb, ss, qkv, layer, *, dims: SeamDims, has_next: bool,
                   eps: float, programs: int, stages: int | None = None, profile_dir: str = ""):
  """attn [Mp, A], stream (`reference.seam_layout`, layers stacked), r [Mp,
  D] f32 (this layer's input residual), xb [Mp, D] (scratch), ss [Mp, 64]
  f32 (zero), qkv [Mp, Nq] f32 (any); Mp a multiple of 8. Returns (r', xb,
  ss, qkv): the residual after the layer, scratch, ss zero again and the
  next layer's unscaled q/k/v (both when has_next).

  `profile_dir`: where each call writes a trace of the compute warpgroups'
  phases (Mosaic GPU's in-kernel profiler over the named scopes "o",
  "o_epilogue", "mlp_start", "gate_up", "swiglu", "down", "qkv"), to find
  which phase bounds the kernel; empty: no profiling."""
  mp, d = r.shape
  dtype = stream.dtype
  # the profiler's buffer takes shared memory: one weight slot less
  stages = stages or default_stages(dims, mp) - bool(profile_dir)
  n_mlp, n_own = dims.mlp_programs, dims.owners
  o_steps, gu_steps, down_steps = dims.o_steps, dims.gate_up_steps, dims.down_steps
  mlp_steps = dims.mlp_steps
  n_qkv = dims.qkv_tiles if has_next else 0
  k_tiles = d // BLOCK
  rows = pl.ds(0, mp)

  def body(layer_gmem, attn_gmem, w_gmem, r_gmem, xb_gmem, ss_gmem, qkv_gmem):
    p = lax.axis_index("p")
    base = layer_gmem[0] * dims.blocks
    next_qkv = base + dims.blocks + dims.o_blocks + dims.mlp_blocks
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))
    owner = p - n_mlp
    is_owner = (owner >= 0) & (owner < n_own)
    n_o = jnp.where(is_owner, o_steps, 0)
    n_m = jnp.where(p < n_mlp, mlp_steps, 0)
    n_q = jnp.where(p < n_qkv, 1, 0)

    def down_block(t):  # program p's down steps from block p on, so that
      return (t - gu_steps + p) % down_steps  # the programs add into different columns at a time

    def block_of(s):
      o_block = base + owner * o_steps + s
      m_block = base + dims.o_blocks + p * mlp_steps + jnp.where(
          s < gu_steps, s, gu_steps + down_block(s))
      return jnp.where(s < n_o, o_block, jnp.where(s < n_o + n_m, m_block, next_qkv + p))

    def scope(xs_smem, h_smem, out_smem, attn_bar, x_bar, stage_bar):
      def tile(k):  # activation tile k (see `activation_rows`)
        return xs_smem.at[pl.ds(k * mp, ROWS)]

      def zero_rows(dst):
        """Stores zeros into dst [Mp, 64] through out slot 0."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[0] = jnp.zeros((ROWS, BLOCK), jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[0, rows], dst)

      @phase("o_epilogue")
      def owner_epilogue(acc):
        """x_mid = r + the o product into r and (bf16) xb, the sums of its
        squares into ss; then barrier 0."""
        plgpu.wgmma_wait(0)
        plgpu.barrier_wait(stage_bar)
        x_mid = acc[...] + plgpu.load(out_smem.at[0], (), layout=plgpu.Layout.WGMMA)
        squares = jnp.sum(x_mid * x_mid, axis=1)
        out_smem[0] = x_mid
        out_smem[1] = lax.broadcast_in_dim(squares, (ROWS, BLOCK), (0,))
        h_smem[...] = x_mid.astype(dtype)
        plgpu.commit_smem()
        cols = pl.ds(owner * BLOCK, BLOCK)
        plgpu.copy_smem_to_gmem(out_smem.at[0, rows], r_gmem.at[:, cols])
        plgpu.copy_smem_to_gmem(h_smem.at[rows], xb_gmem.at[:, cols])
        plgpu.copy_smem_to_gmem(out_smem.at[1, rows], ss_gmem, reduction_op="add")
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(sems.at[0], 1, memory_scope="gpu")

      def compute_context(run_pipeline):
        def accumulators(acc_a, acc_b):
          @pl.when(is_owner)
          def _owner_prologue():
            for k in range(dims.a // BLOCK):
              plgpu.copy_gmem_to_smem(attn_gmem.at[:, pl.ds(k * BLOCK, BLOCK)],
                                      xs_smem.at[pl.ds(k * mp, mp)], attn_bar)
            plgpu.copy_gmem_to_smem(r_gmem.at[:, pl.ds(owner * BLOCK, BLOCK)],
                                    out_smem.at[0, rows], stage_bar)

          if has_next:
            @pl.when(p < dims.nq // BLOCK)
            def _zero_qkv():  # before barrier 1, which every q/k/v add waits for
              zero_rows(qkv_gmem.at[:, pl.ds(p * BLOCK, BLOCK)])

          run_pipeline((acc_a, acc_b))
          plgpu.wait_smem_to_gmem(0)

          if has_next:
            @pl.when(p == programs - 1)
            def _zero_ss():  # after every MLP program has read it
              plgpu.semaphore_wait(sems.at[1], n_mlp, decrement=False, memory_scope="gpu")
              zero_rows(ss_gmem)
              plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(accumulators, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                      plgpu.ACC((ROWS, BLOCK), jnp.float32))

      def step(idx, w_smem, accs):
        acc_a, acc_b = accs
        s = idx[0]
        t = s - n_o  # the MLP programs have no o steps
        w_lo, w_hi = w_smem.at[:, pl.ds(0, BLOCK)], w_smem.at[:, pl.ds(BLOCK, BLOCK)]

        @pl.when(s < n_o)
        @phase("o")
        def _o():
          @pl.when(s == 0)
          def _():
            plgpu.barrier_wait(attn_bar)
          plgpu.wgmma(acc_a, tile(2 * s), w_lo)
          plgpu.wgmma(acc_a, tile(2 * s + 1), w_hi)
          plgpu.wgmma_wait(2)  # the last step's products are done: its slot goes back

          @pl.when(s == o_steps - 1)
          def _():
            owner_epilogue(acc_a)

        in_mlp = (s >= n_o) & (s < n_o + n_m)

        @pl.when(in_mlp & (t == 0))
        @phase("mlp_start")
        def _mlp_start():
          plgpu.semaphore_wait(sems.at[0], n_own, decrement=False, memory_scope="gpu")
          for k in range(k_tiles):
            plgpu.copy_gmem_to_smem(xb_gmem.at[:, pl.ds(k * BLOCK, BLOCK)],
                                    xs_smem.at[pl.ds(k * mp, mp)], x_bar)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.copy_gmem_to_smem(ss_gmem, out_smem.at[0, rows], stage_bar)
          plgpu.barrier_wait(x_bar)

        @pl.when(in_mlp & (t < gu_steps))
        @phase("gate_up")
        def _gate_up():
          plgpu.wgmma(acc_a, tile(t), w_lo)
          plgpu.wgmma(acc_b, tile(t), w_hi)
          plgpu.wgmma_wait(2)

        @pl.when(in_mlp & (t == gu_steps - 1))
        @phase("swiglu")
        def _swiglu():
          plgpu.wgmma_wait(0)
          plgpu.barrier_wait(stage_bar)
          ss = plgpu.load(out_smem.at[0], (), layout=plgpu.Layout.WGMMA)
          scale = lax.rsqrt(ss * (1.0 / d) + eps)
          g = acc_a[...] * scale
          u = acc_b[...] * scale
          h_smem[...] = (g * jax.nn.sigmoid(g) * u).astype(dtype)
          plgpu.commit_smem()

        def store_halves(acc_lo, acc_hi, dst, first):
          """Reduce-adds the two [Mp, 64] products into dst's columns first ..."""
          for half, acc in enumerate((acc_lo, acc_hi)):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's last store has read it
            out_smem[half] = acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[half, rows],
                                    dst.at[:, pl.ds(first + half * BLOCK, BLOCK)],
                                    reduction_op="add")

        @pl.when(in_mlp & (t >= gu_steps))
        @phase("down")
        def _down():
          def halves(acc_lo, acc_hi):
            plgpu.wgmma(acc_lo, h_smem, w_lo)
            plgpu.wgmma(acc_hi, h_smem, w_hi)
            plgpu.wgmma_wait(0)
            store_halves(acc_lo, acc_hi, r_gmem, down_block(t) * COLS)

          pl.run_scoped(halves, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                        plgpu.ACC((ROWS, BLOCK), jnp.float32))

        @pl.when(in_mlp & (t == mlp_steps - 1))
        def _mlp_end():
          plgpu.wait_smem_to_gmem(0)
          plgpu.semaphore_signal(sems.at[1], 1, memory_scope="gpu")

        if has_next:
          @pl.when(s == n_o + n_m)
          @phase("qkv")
          def _qkv():
            plgpu.semaphore_wait(sems.at[1], n_mlp, decrement=False, memory_scope="gpu")
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            k = p % k_tiles
            plgpu.copy_gmem_to_smem(r_gmem.at[:, pl.ds(k * BLOCK, BLOCK)], out_smem.at[0, rows],
                                    stage_bar)
            plgpu.barrier_wait(stage_bar)
            x = plgpu.load(out_smem.at[0], (), layout=plgpu.Layout.WGMMA)
            tile(0)[...] = x.astype(dtype)
            plgpu.commit_smem()

            def halves(acc_lo, acc_hi):
              plgpu.wgmma(acc_lo, tile(0), w_lo)
              plgpu.wgmma(acc_hi, tile(0), w_hi)
              plgpu.wgmma_wait(0)
              store_halves(acc_lo, acc_hi, qkv_gmem, (p // k_tiles) * COLS)

            pl.run_scoped(halves, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                          plgpu.ACC((ROWS, BLOCK), jnp.float32))

        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(n_o + n_m + n_q,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((BLOCK, COLS), lambda s: (block_of(s), 0),
                                    transforms=tiled(COLS, 2), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(w_gmem)

    pl.run_scoped(
        scope,
        plgpu.SMEM((activation_rows(dims, mp), BLOCK), dtype,
                   transforms=tiled(BLOCK, 2)),  # attn or xb, whole
        plgpu.SMEM((ROWS, BLOCK), dtype, transforms=tiled(BLOCK, 2)),  # h
        plgpu.SMEM((2, ROWS, BLOCK), jnp.float32, transforms=tiled(BLOCK, 4)),
        plgpu.Barrier(num_arrivals=dims.a // BLOCK),
        plgpu.Barrier(num_arrivals=k_tiles),
        plgpu.Barrier(num_arrivals=1),
        collective_axes="wg")

  mesh = plgpu.Mesh(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  # a program's compute warpgroup enters ~33 regions (one per step, two more)
  params = compiler_params(profile_dir, regions=64)
  refs = [jax.new_ref(v) for v in (r, xb, ss, qkv)]
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  pl.kernel(body, out_type=(), mesh=mesh, compiler_params=params)(layer, attn, stream, *refs)
  return tuple(ref[...] for ref in refs)
