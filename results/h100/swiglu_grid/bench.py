"""The draft MLP kernel's two schedules, alone: a chain of layers with
distinct weights (more bytes than L2 holds), each layer's output the next
one's input, at the 0.5B and 1B drafts' shapes.

  blocks  one program per F block of 64 (`swiglu_mlp_gpu`)
  grid    one program per SM, gate/up and down phases met at a grid barrier
          (`swiglu_mlp_grid_gpu`)

Time: wall clock of queued calls of the jitted chain, warm-up excluded,
block_until_ready, best of 3 rounds; us per layer = call / layers (so the
kernel boundaries of a chain are in it, as in a draft pass). Each variant's
output is checked against the reference chain. Bandwidth: the layer's weight
bytes over the time, against the copy bandwidth measured in the same process.

Usage (on the GPU): python results/h200/swiglu_grid/bench.py --out=$OUT
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.swiglu_mlp.ops import swiglu_mlp  # noqa: E402
from kernels.swiglu_mlp.reference import stream_layout  # noqa: E402

SHAPES = {"0.5B": (896, 4864, 12), "1B": (2048, 8192, 6)}  # D, F, layers in the chain


def weights(d, f, layers, seed):
  out = []
  for i in range(layers):
    kg, kd = jax.random.split(jax.random.key(seed + i))
    gate_up = (jax.random.normal(kg, (d, 2 * f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    out.append(stream_layout(gate_up, down))
  return out


@functools.partial(jax.jit, static_argnames=("impl", "schedule", "stages", "programs"))
def chain(x, ws, *, impl, schedule="grid", stages=None, programs=None):
  r = x.astype(jnp.float32)
  for w in ws:
    r = swiglu_mlp(r.astype(jnp.bfloat16), w, r, impl=impl, schedule=schedule, stages=stages,
                   programs=programs)
  return r


def timed(fn, *args, repeats):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  best = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats):
      out = fn(*args)
    jax.block_until_ready(out)
    best.append((time.perf_counter() - t0) / repeats)
  return min(best) * 1e6


def copy_bandwidth():
  a = jnp.ones((2**30 // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  us = timed(f, a, repeats=20)
  return 2 * a.size * 2 / (us * 1e-6)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--rows", default="16,1,64")
  ap.add_argument("--variants", default="blocks,grid:4,grid:5,grid:3,grid:4:128")
  ap.add_argument("--repeats", type=int, default=30)
  args = ap.parse_args()
  bw = copy_bandwidth()
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                copy_tb_per_s=bw / 1e12, runs=[])
  print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
  for name, (d, f, layers) in SHAPES.items():
    ws = weights(d, f, layers, 0)
    layer_bytes = ws[0].size * 2
    for m in (int(r) for r in args.rows.split(",")):
      x = jax.random.normal(jax.random.key(m), (m, d), jnp.float32).astype(jnp.bfloat16)
      want = np.asarray(chain(x, ws, impl="reference"))
      for variant in args.variants.split(","):
        schedule, *knobs = variant.split(":")
        kw = dict(stages=int(knobs[0]) if knobs else None,
                  programs=int(knobs[1]) if len(knobs) > 1 else None)
        rec = dict(shape=name, rows=m, variant=variant, layers=layers, layer_mb=layer_bytes / 1e6)
        try:
          fn = functools.partial(chain, impl="gpu", schedule=schedule, **kw)
          us = timed(fn, x, ws, repeats=args.repeats) / layers
          got = np.asarray(fn(x, ws))
          rec.update(us_per_layer=us, tb_per_s=layer_bytes / (us * 1e-6) / 1e12,
                     copy_bw_share=layer_bytes / (us * 1e-6) / bw,
                     max_rel_err=float(np.abs(got - want).max() / np.abs(want).max()))
        except Exception as e:  # noqa: BLE001 -- a variant that fails is reported
          rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        result["runs"].append(rec)
        print(json.dumps(rec)[:400], flush=True)
        with open(f"{args.out}/bench.json", "w") as fh:
          json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main()
