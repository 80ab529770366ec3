"""Probe: the time floor of a persistent draft kernel, against one kernel per
phase (not part of the package).

A draft layer-pass at 16 rows is a chain of dependent phases (q/k/v, the
attention, o, the MLP), each of which needs every program's output of the
phase before. Today each phase is its own kernel; a persistent kernel would
keep one program per SM alive over all layers, stream the weights through
shared memory without a break (the memory warpgroup runs ahead of the
dependencies: weights do not depend on activations) and replace each
kernel boundary by a grid barrier (a GMEM semaphore every program signals
and waits for).

This probe measures that structure with the 0.5B draft's bytes and no
model math: program p streams its share of each phase's bytes as [64 x 128]
bf16 tiles (two 64-column WGMMAs per tile against a 64-row activation tile),
and at each phase's end (sync=True) stores a [64, 64] bf16 product
(exchange=True), signals the phase's semaphore and waits until every
program has; the next phase loads another program's product as its
activation tile. Variants, one process, kernel time by `jax.profiler`-free
wall clock of a jitted chain (block_until_ready, warm-up excluded):

  stream    one persistent kernel, no barrier: the bytes alone
  barrier   one persistent kernel, grid barriers, no exchange
  exchange  one persistent kernel, barriers and the activations exchanged
  kernels   one kernel per phase (the same programs and bytes, the
            activation exchanged through GMEM between kernels): today's
            structure

Usage (on the GPU): python results/h200/persistent_layer/probe.py --out=$OUT
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.swiglu_mlp.gpu import _transforms  # noqa: E402  (shared-memory tiling + swizzle)

ROWS = 64  # the WGMMA row operand (16 draft rows padded)
K = 64  # a weight tile's rows (the contraction)
COLS = 128  # a weight tile's columns: [64 x 128] bf16 = 16 KB
DTYPE = jnp.bfloat16


def phase_tiles(hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=4864, rows=16, window=512,
                programs=132):
  """Tiles of 16 KB a program streams per phase of one layer: q/k/v,
  attention (the window's K and V rows), o, MLP."""
  tile = K * COLS * 2
  qkv = hidden * (heads + 2 * kv_heads) * head_dim * 2
  attention = rows * kv_heads * window * head_dim * 2 * 2
  o = heads * head_dim * hidden * 2
  mlp = hidden * ffn * 3 * 2
  return tuple(max(1, round(b / tile / programs)) for b in (qkv, attention, o, mlp))


def _launch(w, act_ref, *, layers, phases, programs, sync, exchange, stages, w_offset=0,
            first_region=0):
  """One kernel over `layers` x `phases` (see `persistent`), in place on
  act_ref, whose two regions of programs * ROWS rows are the phases'
  inputs in turn: global phase g reads region (first_region + g) mod 2 and
  writes the other. Program p reads program p + 1's rows except at the
  first phase's first read (its own). `w_offset`: the first weight tile
  row block."""
  t_layer = sum(phases)
  steps = layers * t_layer
  nph = len(phases)
  starts = np.cumsum((0,) + phases)[:-1].tolist()
  ends = np.cumsum(phases).tolist()

  def phase_index(t):
    k = jnp.int32(0)
    for s in starts[1:]:
      k = k + (t >= s).astype(jnp.int32)
    return k

  def any_equal(t, values):
    out = t == values[0]
    for v in values[1:]:
      out = out | (t == v)
    return out

  def rows(region, p):
    return pl.ds(((region % 2) * programs + p) * ROWS, ROWS)

  def body(w_gmem, act_gmem):
    p = lax.axis_index("p")
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((layers * nph,)))
    neighbour = (p + 1) % programs

    def scope(x_smem, y_smem, bar):
      def compute_context(run_pipeline):
        def accumulators(acc_lo, acc_hi):
          src = p if first_region == 0 else neighbour
          plgpu.copy_gmem_to_smem(act_gmem.at[rows(first_region, src)], x_smem, bar)
          plgpu.barrier_wait(bar)
          run_pipeline((acc_lo, acc_hi))
          plgpu.wgmma_wait(0)

        pl.run_scoped(accumulators, plgpu.ACC((ROWS, 64), jnp.float32),
                      plgpu.ACC((ROWS, 64), jnp.float32))

      def step(idx, w_smem, accs):
        acc_lo, acc_hi = accs
        s = idx[0]
        t = s % t_layer
        g = (s // t_layer) * nph + phase_index(t)

        @pl.when(any_equal(t, starts) & (s > 0))
        def _phase_start():
          plgpu.wgmma_wait(0)
          if sync:
            plgpu.semaphore_wait(sems.at[g - 1], programs, decrement=False,
                                 memory_scope="gpu")
          if exchange:
            plgpu.copy_gmem_to_smem(act_gmem.at[rows(first_region + g, neighbour)], x_smem, bar)
            plgpu.barrier_wait(bar)
          acc_lo[...] = jnp.zeros((ROWS, 64), jnp.float32)
          acc_hi[...] = jnp.zeros((ROWS, 64), jnp.float32)

        plgpu.wgmma(acc_lo, x_smem, w_smem.at[:, pl.ds(0, 64)])
        plgpu.wgmma(acc_hi, x_smem, w_smem.at[:, pl.ds(64, 64)])
        plgpu.wgmma_wait(2)

        def store():  # this phase's product, the next phase's input
          plgpu.wgmma_wait(0)
          y_smem[...] = (acc_lo[...] + acc_hi[...]).astype(DTYPE)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(y_smem, act_gmem.at[rows(first_region + g + 1, p)])
          plgpu.wait_smem_to_gmem(0)

        @pl.when(any_equal(t, [e - 1 for e in ends]))
        def _phase_end():
          plgpu.wgmma_wait(0)
          if exchange:
            store()
          if sync:
            plgpu.semaphore_signal(sems.at[g], 1, memory_scope="gpu")

        if not exchange:  # the last product is written all the same: the kernel has an output
          pl.when(s == steps - 1)(store)
        return accs

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(steps,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((K, COLS), lambda s: ((w_offset + s) * programs + p, 0),
                                    transforms=_transforms(COLS, 2), delay_release=1)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages,
          compute_context=compute_context)
      pipeline(w_gmem)

    pl.run_scoped(scope, plgpu.SMEM((ROWS, K), DTYPE, transforms=_transforms(K, 2)),
                  plgpu.SMEM((ROWS, K), DTYPE, transforms=_transforms(K, 2)),
                  plgpu.Barrier(num_arrivals=1), collective_axes="wg")

  mesh = plgpu.Mesh(grid=(programs,), grid_names=("p",), num_threads=2, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  pl.kernel(body, out_type=(), mesh=mesh, compiler_params=params)(w, act_ref)


@functools.partial(jax.jit, static_argnames=("layers", "phases", "programs", "sync", "exchange",
                                             "stages"))
def persistent(w, act, *, layers, phases, programs, sync, exchange, stages):
  """w: [>= layers * sum(phases) * programs * K, COLS] (program p's tile of
  step s: row block s * programs + p); act: [2 * programs * ROWS, K], two
  regions the phases read and write in turn (the barrier after phase g
  orders phase g + 1's writes after every read of phase g). One kernel;
  returns the last phase's output region."""
  ref = jax.new_ref(act)
  _launch(w, ref, layers=layers, phases=phases, programs=programs, sync=sync,
          exchange=exchange, stages=stages)
  return _last_region(ref[...], layers * len(phases), programs)


@functools.partial(jax.jit, static_argnames=("layers", "phases", "programs", "stages"))
def per_phase_kernels(w, act, *, layers, phases, programs, stages):
  """The same bytes and products, one kernel per phase."""
  ref = jax.new_ref(act)
  offset = 0
  for layer in range(layers):
    for k, n in enumerate(phases):
      g = layer * len(phases) + k
      _launch(w, ref, layers=1, phases=(n,), programs=programs, sync=False, exchange=True,
              stages=stages, w_offset=offset, first_region=g)
      offset += n
  return _last_region(ref[...], layers * len(phases), programs)


def _last_region(act, n_phases, programs):
  last = n_phases % 2
  return act[last * programs * ROWS:(last + 1) * programs * ROWS]


def timed(fn, *args, repeats):
  jax.block_until_ready(fn(*args))  # compile and warm up
  jax.block_until_ready(fn(*args))
  best = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats):
      out = fn(*args)
    jax.block_until_ready(out)
    best.append((time.perf_counter() - t0) / repeats)
  return min(best) * 1e6


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--layers", type=int, default=24)
  ap.add_argument("--programs", type=int, default=132)
  ap.add_argument("--stages", type=int, default=6)
  ap.add_argument("--repeats", type=int, default=50)
  ap.add_argument("--variants", default="stream,barrier,exchange,kernels")
  ap.add_argument("--phases", default="")  # e.g. "1,2,1,12"; default: the 0.5B's
  ap.add_argument("--tag", default="probe")
  args = ap.parse_args()
  programs, layers = args.programs, args.layers
  phases = (tuple(int(v) for v in args.phases.split(",")) if args.phases
            else phase_tiles(programs=programs))
  t_layer = sum(phases)
  key = jax.random.key(0)
  # each phase's weights scaled so that its product keeps the activations' scale
  # (each output sums 2 x 64 x tiles products), which makes the exchange check meaningful
  tiles_of_step = np.concatenate([np.full(n, n) for n in phases])
  row_scale = np.repeat(np.tile(1 / np.sqrt(128 * tiles_of_step), layers), programs * K)
  w = (jax.random.normal(key, (layers * t_layer * programs * K, COLS))
       * jnp.asarray(row_scale, jnp.float32)[:, None]).astype(DTYPE)
  act = jax.random.normal(jax.random.key(1), (2 * programs * ROWS, K), DTYPE)
  layer_bytes = t_layer * programs * K * COLS * 2
  result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                layers=layers, programs=programs, phases=phases, stages=args.stages,
                layer_mb=layer_bytes / 1e6, variants={})
  common = dict(layers=layers, phases=phases, programs=programs, stages=args.stages)
  fns = {
      "stream": functools.partial(persistent, sync=False, exchange=False, **common),
      "barrier": functools.partial(persistent, sync=True, exchange=False, **common),
      "exchange": functools.partial(persistent, sync=True, exchange=True, **common),
      "kernels": functools.partial(per_phase_kernels, **common),
  }
  outputs = {}
  for name in args.variants.split(","):
    try:
      us = timed(fns[name], w, act, repeats=args.repeats)
    except Exception as e:  # a variant that fails to lower or run is reported, not fatal
      result["variants"][name] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
      print(name, "failed:", type(e).__name__, str(e)[:500], flush=True)
      continue
    outputs[name] = np.asarray(fns[name](w, act).astype(jnp.float32))
    per_layer = us / layers
    result["variants"][name] = dict(
        us_per_call=us, us_per_layer=per_layer,
        tb_per_s=layer_bytes / (per_layer * 1e-6) / 1e12)
    print(f"{name:9s} {us:9.1f} us a call, {per_layer:6.2f} us a layer, "
          f"{layer_bytes / (per_layer * 1e-6) / 1e12:5.2f} TB/s", flush=True)
  # the exchanged activations agree between the persistent kernel and the
  # per-phase kernels: the barriers order the exchange as kernel boundaries do
  if "exchange" in outputs and "kernels" in outputs:
    scale = float(np.max(np.abs(outputs["kernels"])))
    diff = float(np.max(np.abs(outputs["exchange"] - outputs["kernels"]))) / scale
    result["exchange_vs_kernels_max_rel_diff"] = diff
    result["kernels_max_abs"] = scale
    print(f"exchange vs kernels: max |diff| / max |kernels| = {diff:.3g} (max |kernels| {scale:.3g})")
  with open(f"{args.out}/{args.tag}.json", "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
