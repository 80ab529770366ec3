"""Probe: where one `layer_seam` call's time goes, phase by phase, from
Mosaic GPU's in-kernel profiler (`layer_seam_gpu(profile_dir=...)`: each
compute warpgroup's named regions "o", "o_epilogue", "mlp_start" (the wait
at barrier 0 and the load of the normed rows), "gate_up", "swiglu", "down",
"qkv" (the wait at barrier 1, then the product)), and the same for the
default draft's MLP kernel (`swiglu_mlp_gpu`: "gate_up", "swiglu",
"down"). Not part of the package.

At the 0.5B draft's shapes (D 896, A 896, F 4864, Nq 1152), Mp rows: the
call timed unprofiled (wall clock of 200 queued calls, fastest of 3, after
a warm-up), then profiled once; the trace summarised per region (how many
programs enter it, its median and largest duration, when the first and last
program leave it, in us from the first event of the call), and the profiled
outputs compared with the unprofiled ones.

Usage (on a Hopper GPU): python results/h200/layer_seam/profile_probe.py --out=$OUT
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.layer_seam.gpu import layer_seam_gpu, programs_needed  # noqa: E402
from kernels.layer_seam.reference import SeamDims, seam_layout  # noqa: E402
from kernels.swiglu_mlp.gpu import swiglu_mlp_gpu  # noqa: E402
from kernels.swiglu_mlp.reference import stream_layout  # noqa: E402

QWEN_05B = SeamDims(d=896, a=896, f=4864, nq=1152)


def operands(dims: SeamDims, mp: int, seed: int = 0):
  """Two layers' stream and one call's inputs (rows past 16 zero)."""
  keys = iter(jax.random.split(jax.random.key(seed), 16))

  def normal(shape, dtype=jnp.bfloat16):
    return (jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)

  layers = [seam_layout(normal((dims.a, dims.d)), normal((dims.d, 2 * dims.f)),
                        normal((dims.f, dims.d)), normal((dims.d, dims.nq))) for _ in range(2)]
  stream = jnp.concatenate(layers)
  rows = min(mp, 16)
  pad = ((0, mp - rows), (0, 0))
  r = jnp.pad(jax.random.normal(next(keys), (rows, dims.d), jnp.float32), pad)
  attn = jnp.pad(jax.random.normal(next(keys), (rows, dims.a), jnp.float32), pad)
  return (attn.astype(jnp.bfloat16), stream, r, jnp.zeros((mp, dims.d), jnp.bfloat16),
          jnp.zeros((mp, 64), jnp.float32), jnp.zeros((mp, dims.nq), jnp.float32),
          jnp.int32(0))


def timed_us(fn, args, calls: int = 200) -> float:
  jax.block_until_ready(fn(*args))
  best = []
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best.append((time.perf_counter() - start) / calls * 1e6)
  return min(best)


def summarise(trace_path: str) -> dict:
  """Per region name: programs that entered it, median / largest duration,
  and when the first and the last program left it (us from the call's
  first event)."""
  with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  t0 = min(e["ts"] for e in events)
  open_at, spans = {}, {}
  for e in events:
    key = (e["pid"], e["tid"], e["name"])
    if e["ph"] == "B":
      open_at.setdefault(key, []).append(e["ts"])
    elif open_at.get(key):
      begin = open_at[key].pop()
      spans.setdefault(e["name"], []).append((begin - t0, e["ts"] - t0))
  out = {}
  for name, s in sorted(spans.items(), key=lambda kv: min(b for b, _ in kv[1])):
    durations = np.array([end - begin for begin, end in s])
    ends = np.array([end for _, end in s])
    out[name] = dict(regions=len(s), median_us=float(np.median(durations)),
                     max_us=float(durations.max()), sum_us=float(durations.sum()),
                     first_begin_us=float(min(b for b, _ in s)),
                     first_end_us=float(ends.min()), last_end_us=float(ends.max()))
  out["_call_span_us"] = float(max(e["ts"] for e in events) - t0)
  return out


def profile(name: str, call, inputs, out_dir: str) -> dict:
  """`call(*inputs, profile_dir=...)` timed unprofiled, then profiled once:
  its regions summarised and the two results compared."""
  plain = jax.jit(call)
  us = timed_us(plain, inputs)
  want = jax.block_until_ready(plain(*inputs))
  trace_dir = os.path.join(out_dir, f"trace_{name}")
  os.makedirs(trace_dir, exist_ok=True)
  got = jax.block_until_ready(jax.jit(functools.partial(call, profile_dir=trace_dir))(*inputs))
  diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  traces = sorted(glob.glob(os.path.join(trace_dir, "*trace.json")))
  rec = dict(kernel=name, us_per_call=us, profiled_max_abs_diff=diff, traces=len(traces))
  if traces:
    rec["regions"] = summarise(traces[-1])
  print(json.dumps(rec), flush=True)
  return rec


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--rows", default="16,32")
  args = ap.parse_args()
  dims = QWEN_05B
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, dims=vars(dims),
                runs=[])
  for mp in [int(m) for m in args.rows.split(",")]:
    call = functools.partial(layer_seam_gpu, dims=dims, has_next=True, eps=1e-6,
                             programs=programs_needed(dims))
    result["runs"].append(profile(f"layer_seam_mp{mp}", call, operands(dims, mp), args.out))
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (16, dims.d), jnp.float32).astype(jnp.bfloat16)
  gate_up = (jax.random.normal(keys[1], (dims.d, 2 * dims.f)) / np.sqrt(dims.d)).astype(x.dtype)
  down = (jax.random.normal(keys[2], (dims.f, dims.d)) / np.sqrt(dims.f)).astype(x.dtype)
  residual = jax.random.normal(keys[3], (16, dims.d), jnp.float32).astype(x.dtype)
  result["runs"].append(profile("swiglu_mlp_m16", swiglu_mlp_gpu,
                                (x, stream_layout(gate_up, down), residual), args.out))
  with open(os.path.join(args.out, "profile_probe.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
