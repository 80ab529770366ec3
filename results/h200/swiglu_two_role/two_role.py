"""Probe: swiglu_mlp with two roles. Programs 0..P-1 (one per F block) run the
gate/up steps and the SwiGLU and store h of their block; programs P.. each own
one column tile of down and a group of F blocks: they stream their down tiles
while the gate/up programs run, wait until their group's h is stored, load it
and reduce-add h @ down into their columns of the output.

sync: "group" (one counter a group, one wait a down program), "cas" / "load"
(one semaphore a block, waited on by a CAS loop or by loads and given back by
a signal of -1), "none" (no wait: wrong results, the time without the
dependency). Interpret mode (no global semaphores) runs the roles as two
kernels."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS
from kernels.swiglu_mlp.gpu import ROWS, _transforms, interpret_params


def split(blocks: int, cols: int, groups: int):
  per_group = -(-blocks // groups)
  groups = -(-blocks // per_group)
  return per_group, groups



@functools.partial(jax.jit, static_argnames=("stages", "down_stages", "groups", "interpret", "sync"))
def swiglu_mlp_two_role(x, w_stream, residual, *, stages: int = 7, down_stages: int = 6,
                        groups: int = 8, interpret: bool = False, sync: str = "cas"):
  m, d = x.shape
  blocks = w_stream.shape[0]
  itemsize = jnp.dtype(x.dtype).itemsize
  gate_up_steps = d // BLOCK
  cols = d // TILE_COLS
  tiles = gate_up_steps + cols  # streamed tiles per F block
  per_group, groups = split(blocks, cols, groups)
  programs = blocks + groups * cols
  w_rows = w_stream.reshape(-1, TILE_COLS)  # tile t of block b: rows (b * tiles + t) * 64

  def down_program(p, base):
    """A down program's group g, column tile c, first F block and block
    count; evaluated where it is used (interpret mode evaluates the pipelines'
    index maps apart from the kernel body). base: the kernel's first down
    program's id."""
    q = jnp.maximum(p - base, 0)
    g, c = q // cols, q % cols
    return g, c, g * per_group, jnp.minimum(per_group, blocks - g * per_group)

  def gate_up_role(x_gmem, w_gmem, h_gmem, sems):
      p = lax.axis_index("p")
      def scope(h_smem):
        def compute_context(run_pipeline):
          def accumulators(acc_gate, acc_up):
            run_pipeline((acc_gate, acc_up))
            plgpu.wgmma_wait(0)
            gate = acc_gate[...]
            h_smem[...] = (gate * jax.nn.sigmoid(gate) * acc_up[...]).astype(h_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_smem.at[pl.ds(0, m)], h_gmem.at[p])
            plgpu.wait_smem_to_gmem(0)  # h is in GMEM before the signal
            if sems is not None and sync == "group":
              pl.semaphore_signal(sems.at[p // per_group], 1)
            elif sems is not None and sync != "none":
              pl.semaphore_signal(sems.at[p], cols)

          pl.run_scoped(accumulators, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                        plgpu.ACC((ROWS, BLOCK), jnp.float32))

        def step(idx, x_smem, w_smem, accs):
          acc_gate, acc_up = accs
          plgpu.wgmma(acc_gate, x_smem, w_smem.at[:, pl.ds(0, BLOCK)])
          plgpu.wgmma(acc_up, x_smem, w_smem.at[:, pl.ds(BLOCK, BLOCK)])
          plgpu.wgmma_wait(2)
          return accs

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(gate_up_steps,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((ROWS, BLOCK), lambda s: (0, s),
                                      transforms=_transforms(BLOCK, itemsize), delay_release=1),
                      plgpu.BlockSpec((BLOCK, TILE_COLS), lambda s: (p * tiles + s, 0),
                                      transforms=_transforms(BLOCK, itemsize), delay_release=1)],
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
            compute_context=compute_context)
        pipeline(x_gmem, w_gmem)

      pl.run_scoped(scope, plgpu.SMEM((ROWS, BLOCK), x.dtype,
                                      transforms=_transforms(BLOCK, itemsize)),
                    collective_axes="wg")

  def down_role(w_gmem, h_gmem, out_gmem, sems, base):
      p = lax.axis_index("p")

      def scope(h_smem, out_smem, bar):
        def compute_context(run_pipeline):
          def accumulators(acc_lo, acc_hi):
            g, c, first, count = down_program(p, base)
            out_block = out_gmem.at[g] if interpret else out_gmem
            if sems is not None and sync == "group":  # one count a block of the group
              plgpu.semaphore_wait(sems.at[g], count, decrement=False, memory_scope="gpu")
            if sems is not None and sync in ("cas", "load"):
              for i in range(per_group):
                @pl.when(i < count)
                def _():
                  if sync == "cas":
                    pl.semaphore_wait(sems.at[first + i], 1)
                  elif sync == "load":
                    plgpu.semaphore_wait(sems.at[first + i], 1, decrement=False, memory_scope="gpu")
              if sync == "load":  # each of the block's cols readers takes one count back
                for i in range(per_group):
                  @pl.when(i < count)
                  def _():
                    pl.semaphore_signal(sems.at[first + i], -1)
            for i in range(per_group):  # one copy a block: only M rows of each slot
              plgpu.copy_gmem_to_smem(h_gmem.at[first + i], h_smem.at[i, pl.ds(0, m)], bar)
            plgpu.barrier_wait(bar)
            run_pipeline((acc_lo, acc_hi))
            plgpu.wgmma_wait(0)
            for half, acc in enumerate((acc_lo, acc_hi)):
              out_smem[half] = acc[...]
            plgpu.commit_smem()
            for half in range(2):
              plgpu.copy_smem_to_gmem(out_smem.at[half, pl.ds(0, m)],
                                      out_block.at[:, pl.ds(c * TILE_COLS + half * BLOCK, BLOCK)],
                                      reduction_op=None if interpret else "add")
            plgpu.wait_smem_to_gmem(0)

          pl.run_scoped(accumulators, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                        plgpu.ACC((ROWS, BLOCK), jnp.float32))

        def step(idx, w_smem, accs):
          acc_lo, acc_hi = accs
          j = idx[0]
          count = down_program(p, base)[3]

          @pl.when(j < count)
          def _():
            plgpu.wgmma(acc_lo, h_smem.at[j], w_smem.at[:, pl.ds(0, BLOCK)])
            plgpu.wgmma(acc_hi, h_smem.at[j], w_smem.at[:, pl.ds(BLOCK, BLOCK)])
            plgpu.wgmma_wait(2)
          return accs

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(per_group,), memory_registers=40,
            in_specs=[plgpu.BlockSpec(
                (BLOCK, TILE_COLS),
                lambda j: (jnp.minimum(down_program(p, base)[2] + j, blocks - 1) * tiles
                           + gate_up_steps + down_program(p, base)[1], 0),
                transforms=_transforms(BLOCK, itemsize), delay_release=1)],
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=down_stages,
            compute_context=compute_context)
        pipeline(w_gmem)

      pl.run_scoped(
          scope,
          plgpu.SMEM((per_group, ROWS, BLOCK), x.dtype, transforms=_transforms(BLOCK, itemsize)),
          plgpu.SMEM((2, ROWS, BLOCK), jnp.float32, transforms=_transforms(BLOCK, 4)),
          plgpu.Barrier(num_arrivals=per_group),
          collective_axes="wg")

  def body(x_gmem, w_gmem, out_gmem, h_gmem):
    p = lax.axis_index("p")
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((blocks,)))  # groups <= blocks
    pl.when(p < blocks)(lambda: gate_up_role(x_gmem, w_gmem, h_gmem, sems))
    pl.when(p >= blocks)(lambda: down_role(w_gmem, h_gmem, out_gmem, sems, blocks))

  mesh = dict(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  h_type = jax.ShapeDtypeStruct((groups * per_group, m, BLOCK), x.dtype)
  if interpret:
    x = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    # the roles as two kernels (interpret mode has no global semaphores)
    mesh.pop("grid")
    h = plgpu.kernel(lambda x_gmem, w_gmem, h_gmem: gate_up_role(x_gmem, w_gmem, h_gmem, None),
                     out_type=h_type, compiler_params=params, interpret=interpret_params(),
                     grid=(blocks,), **mesh)(x, w_rows)
    partials = plgpu.kernel(
        lambda w_gmem, h_gmem, out_gmem: down_role(w_gmem, h_gmem, out_gmem, None, 0),
        out_type=jax.ShapeDtypeStruct((groups, m, d), jnp.float32), compiler_params=params,
        interpret=interpret_params(), grid=(groups * cols,), **mesh)(w_rows, h)
    return residual.astype(jnp.float32) + partials.sum(0)
  out = jax.new_ref(residual.astype(jnp.float32))
  pl.kernel(body, out_type=h_type, mesh=plgpu.Mesh(**mesh), compiler_params=params)(
      x, w_rows, out)
  return out[...]
