"""Probe: the Mosaic GPU sink + window attention
(`kernels.window_attention.mosaic_gpu`, through `ops.window_attention_rows`)
against the package's Triton `window_attention` (4 splits and the XLA merge
of their partials, then a reshape to rows), at the 0.5B draft's shapes
(B 16, 2 KV heads of 7 queries, D 64, 16 sink + 496 window rows), T = 1, 2.

Correctness: one layer against `window_attention_reference` (outputs and
the written cache rows). Speed: a chain of 24 layers' calls in one jit
(distinct caches, donated and fed back: updated in place), wall clock of
30 chains queued by `scripts.benchmarking.queued_steps`, fastest of 3, warm-up
excluded, us per layer: Triton on the packed q/k/v; Mosaic (one program
per (b, h), and four merged in the kernel) with its inputs packed by XLA in
the same jit (`pack_inputs`), and alone (inputs packed once, outside).

Usage (on the GPU): python results/h200/window_mgpu/probe.py --out=$OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.window_attention.mosaic_gpu import (pack_window_inputs,  # noqa: E402
                                                 window_attention_rows_gpu)
from kernels.window_attention.ops import window_attention_rows  # noqa: E402
from scripts.benchmarking import queued_steps  # noqa: E402
from kernels.window_attention.reference import window_attention_reference  # noqa: E402

B, HKV, G, D, SINK, WINDOW, LAYERS = 16, 2, 7, 64, 16, 496, 24
SPLITS = (1, 4)  # one program per (b, h); four, merged by program 0


def tables(lengths, t):
  pos = lengths[:, None] + jnp.arange(t)[None]
  inv = 1.0 / (1e6 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  ang = pos[..., None].astype(jnp.float32) * inv
  return jnp.cos(ang), jnp.sin(ang)


def chain_wall_us(fn, kc, vc, *inputs, repeats=30):
  """us per layer of a 24-layer chain `fn(kc, vc, *inputs) -> (outs, kc,
  vc)` whose caches are donated and fed back (updated in place, as in the
  decoder): `queued_steps` of 30 calls, fastest of 3, warm-up excluded.
  Returns the time and the caches."""
  fn = jax.jit(fn, donate_argnums=(0, 1))

  def step(caches):
    out, kc, vc = fn(*caches, *inputs)
    return (kc, vc), out
  caches, _, _ = queued_steps(step, (kc, vc), 2)
  best = []
  for _ in range(3):
    caches, wall, _ = queued_steps(step, caches, repeats)
    best.append(wall / repeats)
  return min(best) * 1e6 / LAYERS, *caches


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--context", type=int, default=8192)
  args = ap.parse_args()
  s = args.context
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, batch=B, kv_heads=HKV,
                group=G, head_dim=D, sink=SINK, window=WINDOW, layers=LAYERS, context=s, runs=[])
  rng = np.random.default_rng(0)
  lengths = jnp.asarray(rng.integers(600, s - 8, B), jnp.int32)
  keys = jax.random.split(jax.random.key(0), 4)
  for t in (1, 2):
    # fresh caches for each T: its correctness check does not read what T = 1's chains wrote
    kc = jax.random.normal(keys[0], (LAYERS, B, HKV, s, D), jnp.bfloat16)
    vc = jax.random.normal(keys[1], (LAYERS, B, HKV, s, D), jnp.bfloat16)
    qkv = jax.random.normal(keys[2], (LAYERS, B, t, HKV, G + 2, D), jnp.bfloat16)
    cos, sin = tables(lengths, t)
    rec = dict(t=t)
    # correctness, layer 0
    want, wk, wv = window_attention_reference(qkv[0], kc[0], vc[0], lengths, cos, sin,
                                              n_sink=SINK, n_window=WINDOW)
    want_rows = want.reshape(B * t, G * HKV * D).astype(jnp.float32)
    failed = False
    for splits in SPLITS:
      try:
        got, gk, gv = window_attention_rows(qkv[0], jnp.copy(kc[0]), jnp.copy(vc[0]), lengths,
                                            cos, sin, n_sink=SINK, n_window=WINDOW,
                                            impl="mosaic", splits=splits)
        rec[f"splits{splits}_max_abs_diff_out"] = float(jnp.max(jnp.abs(
            got.astype(jnp.float32) - want_rows)))
        rec[f"splits{splits}_max_abs_diff_caches"] = max(
            float(jnp.max(jnp.abs(gk.astype(jnp.float32) - wk.astype(jnp.float32)))),
            float(jnp.max(jnp.abs(gv.astype(jnp.float32) - wv.astype(jnp.float32)))))
      except Exception as e:  # reported, not fatal
        rec[f"splits{splits}_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        failed = True
    rec["max_abs_out"] = float(jnp.max(jnp.abs(want_rows)))
    if failed:
      print(json.dumps(rec), flush=True)
      result["runs"].append(rec)
      continue

    def chain(impl, splits=None):
      def run(kc, vc, qkv):
        outs = []
        for i in range(LAYERS):
          o, k, v = window_attention_rows(qkv[i], kc[i], vc[i], lengths, cos, sin,
                                          n_sink=SINK, n_window=WINDOW, impl=impl,
                                          splits=splits)
          kc, vc = kc.at[i].set(k), vc.at[i].set(v)
          outs.append(o[0, 0])
        return jnp.stack(outs), kc, vc
      return run

    def alone(splits):  # the kernel with its inputs packed once, outside
      def run(kc, vc, blocks):
        outs = []
        for i in range(LAYERS):
          o, k, v = window_attention_rows_gpu(blocks[i], kc[i], vc[i], lengths, g=G, t=t,
                                              n_sink=SINK, n_window=WINDOW, splits=splits)
          kc, vc = kc.at[i].set(k), vc.at[i].set(v)
          outs.append(o[0, 0])
        return jnp.stack(outs), kc, vc
      return run

    blocks = jnp.stack([pack_window_inputs(qkv[i], cos, sin) for i in range(LAYERS)])
    variants = [("triton", chain("gpu"), (qkv,))]
    for splits in SPLITS:
      variants += [(f"mosaic_s{splits}", chain("mosaic", splits), (qkv,)),
                   (f"mosaic_s{splits}_alone", alone(splits), (blocks,))]
    for name, fn, extra in variants:
      try:
        rec[f"{name}_us_per_layer"], kc, vc = chain_wall_us(fn, kc, vc, *extra)
        rec[f"{name}_caches_finite"] = bool(jnp.isfinite(kc).all() & jnp.isfinite(vc).all())
      except Exception as e:
        rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    print(json.dumps(rec), flush=True)
    result["runs"].append(rec)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "probe.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
