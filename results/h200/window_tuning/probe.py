"""Probe: the Triton window attention (`kernels.window_attention`, the step's
draft attention: RoPE, cache writes, sink + window, the XLA merge of its
split programs) at the Qwen2.5-0.5B draft's shapes (2 KV heads of 7
queries, head_dim 64, 16 sink rows) over tunings: window tile rows
(block_w), programs per (sequence, KV head) (splits), warps and stages.

Per (batch, window, T) and tuning: the output and the written cache rows
against `window_attention_reference` (one layer), then GPU time per call of
a jitted chain of LAYERS calls on distinct caches (donated, written in
place; together larger than L2), read from a profiler trace
(`scripts.benchmarking.DeviceTimer`: the busy time of every kernel of the
chain, the merge fusions included), the fastest of 3 chains after a
warm-up. Bytes per call: the sink and window K/V rows read; their share of
the copy bandwidth measured in the same process (a jnp copy of 2 GiB).

Usage (on the GPU): python results/h200/window_tuning/probe.py --out=$OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.window_attention.gpu import default_tuning  # noqa: E402
from kernels.window_attention.ops import window_attention  # noqa: E402
from kernels.window_attention.reference import window_attention_reference  # noqa: E402
from scripts.benchmarking import DeviceTimer  # noqa: E402

HKV, G, D, SINK, LAYERS, CONTEXT = 2, 7, 64, 16, 8, 32768

# (block_w, splits, num_warps, num_stages); None: the package's default
TUNINGS = {
    2032: [None, (128, 16, 4, 1), (128, 16, 4, 2), (128, 8, 4, 3), (128, 8, 4, 2),
           (128, 4, 4, 3), (128, 2, 4, 3), (256, 8, 4, 3), (256, 4, 8, 3), (64, 32, 4, 3),
           (64, 16, 4, 3), (64, 8, 4, 3)],
    496: [None, (128, 4, 4, 1), (128, 2, 4, 3), (64, 8, 4, 3), (64, 4, 4, 3)],
}
SHAPES = [(16, 2032, 1), (8, 2032, 1), (1, 2032, 1), (16, 496, 1)]


def copy_bandwidth() -> float:
  """TB/s of a jnp copy of 2 GiB of bf16 (read + written), fastest of 5."""
  x = jnp.ones((1 << 30,), jnp.bfloat16)
  f = jax.jit(lambda a: a + 1)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t0)
  return 2 * x.nbytes / best / 1e12


def tables(lengths, t, d=D):
  """RoPE cos, sin [B, t, d // 2] of the positions lengths[b] + 0 .. t - 1."""
  pos = lengths[:, None] + jnp.arange(t)[None]
  inv = 1.0 / (1e6 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  ang = pos[..., None].astype(jnp.float32) * inv
  return jnp.cos(ang), jnp.sin(ang)


def tuning_dict(tuning):
  if tuning is None:
    return {}
  block_w, splits, warps, stages = tuning
  return dict(block_w=block_w, splits=splits, num_warps=warps, num_stages=stages)


def chain_us(call, kcs, vcs, qkv):
  """(GPU us per call, caches) of `call(qkv[i], kcs[i], vcs[i]) -> (out,
  kc, vc)` over the layers, in one jit with the caches donated (written in
  place): the fastest of 3 chains after a warm-up."""
  def chain(kcs, vcs, qkv):
    outs, kcs, vcs = [], list(kcs), list(vcs)
    for i in range(len(kcs)):
      o, kcs[i], vcs[i] = call(qkv[i], kcs[i], vcs[i])
      outs.append(o[:, 0, 0])
    return jnp.stack(outs), kcs, vcs
  fn = jax.jit(chain, donate_argnums=(0, 1))
  _, kcs, vcs = jax.block_until_ready(fn(kcs, vcs, qkv))  # compile + warm-up
  with DeviceTimer() as timer:
    for _ in range(3):
      with timer.window("chain"):
        _, kcs, vcs = jax.block_until_ready(fn(kcs, vcs, qkv))
  busy = min(timer.ms("chain") or [float("nan")])
  return busy * 1e3 / len(kcs), kcs, vcs


def measure(b, window, t, tunings, copy_tbs):
  rng = np.random.default_rng(b * 7 + window + t)
  lengths = jnp.asarray(rng.integers(CONTEXT // 2, CONTEXT - 8, b), jnp.int32)
  keys = jax.random.split(jax.random.key(window + b + t), 3)
  # One cache per layer, each donated to the chain: the kernel writes it in
  # place (a slice of one stacked cache would be copied at every call).
  kcs = [jax.random.normal(k, (b, HKV, CONTEXT, D), jnp.bfloat16)
         for k in jax.random.split(keys[0], LAYERS)]
  vcs = [jax.random.normal(k, (b, HKV, CONTEXT, D), jnp.bfloat16)
         for k in jax.random.split(keys[1], LAYERS)]
  qkv = jax.random.normal(keys[2], (LAYERS, b, t, HKV, G + 2, D), jnp.bfloat16)
  cos, sin = tables(lengths, t)
  want, wk, wv = window_attention_reference(qkv[0], kcs[0], vcs[0], lengths, cos, sin,
                                            n_sink=SINK, n_window=window)
  read_bytes = b * HKV * (SINK + window) * D * 2 * 2
  base = dict(batch=b, window=window, t=t, sink=SINK, kv_heads=HKV, group=G, head_dim=D,
              context=CONTEXT, read_bytes=read_bytes,
              default=default_tuning(window))
  run = lambda qkv, kc, vc, **kw: window_attention(qkv, kc, vc, lengths, cos, sin, n_sink=SINK,
                                                   n_window=window, impl="gpu", **kw)
  return time_tunings(base, tunings, run, (want, wk, wv), kcs, vcs, qkv, copy_tbs)


def time_tunings(base, tunings, run, wanted, kcs, vcs, qkv, copy_tbs):
  """Per tuning, a record: `run(qkv, kc, vc, **tuning) -> (out, kc, vc)` on
  layer 0 (copies of its caches) against `wanted` (out, k cache, v cache),
  then GPU us per call of the chain over every layer (`chain_us`) and its
  share of the copy bandwidth (`base["read_bytes"]` per call)."""
  want, wk, wv = wanted
  want = want.astype(jnp.float32)
  out = []
  for tuning in tunings:
    kw = tuning_dict(tuning)
    rec = dict(base, tuning=kw or "default")
    try:
      got, gk, gv = run(qkv[0], jnp.copy(kcs[0]), jnp.copy(vcs[0]), **kw)
      rec["max_abs_diff_out"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
      rec["caches_equal"] = bool(jnp.array_equal(gk, wk) & jnp.array_equal(gv, wv))
      rec["cache_max_abs_diff"] = max(
          float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
          for a, b in ((gk, wk), (gv, wv)))
      rec["us_per_call"], kcs, vcs = chain_us(lambda q, kc, vc, kw=kw: run(q, kc, vc, **kw),
                                              kcs, vcs, qkv)
      rec["share_of_copy_bw"] = (base["read_bytes"] / (rec["us_per_call"] * 1e-6)
                                 / (copy_tbs * 1e12))
    except Exception as e:  # reported, not fatal
      rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(json.dumps(rec), flush=True)
    out.append(rec)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--time_limit_s", type=float, default=240)
  args = ap.parse_args()
  start = time.perf_counter()
  copy_tbs = copy_bandwidth()
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layers=LAYERS,
                copy_tbs=copy_tbs, records=[])
  print(json.dumps({k: v for k, v in result.items() if k != "records"}), flush=True)
  for b, window, t in SHAPES:
    if time.perf_counter() - start > args.time_limit_s:
      print(f"time limit: stopped before {(b, window, t)}", flush=True)
      break
    result["records"] += measure(b, window, t, TUNINGS[window], copy_tbs)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "probe.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
