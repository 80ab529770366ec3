"""Probe: the window / listed attention kernel (`kernels/window_attention/
gpu.py`) with every tile of a program loaded before its math (`unroll`),
against the shipped tunings, at the step's shapes.

Why: at the default 2032-row draft window the kernel takes ~11 us a call in
the 7B + 0.5B step for 16.8 MB of K/V rows (~5.7 us at the copy bandwidth),
whether 128 programs walk 4 tiles or 256 walk 2 (results/h100/window_tuning):
one program keeps one tile's loads in flight while it works on another, too
few bytes per SM to reach the bandwidth. With `unroll` a program issues all
its tiles' loads at once (its tile count's static bound, tiles past the
window masked). The listed form (a sparse verify layer: index blocks, row
gathers) gets the same.

Window (the 0.5B draft: 2 KV heads of 7 queries, head_dim 64, 16 sink +
2032 rows, batch 16, T = 1 and 2): `results/h200/window_tuning/probe.py`'s
`measure` (output and written rows against the reference, then GPU time per
call in a chain of 8 calls on distinct donated caches). Listed (the 7B
verify: 4 KV heads of 7 queries, head_dim 128, T = 5, K = 512, batch 16,
32k context): the same for `sparse_verify_packed`. Writes probe.json and
best.json (the fastest correct tuning of each kind at T = 1 / T = 5, for
variant.py).

Usage (on the GPU): python results/h200/window_unroll/probe.py --out=DIR
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, ROOT)
from kernels.sparse_verify.ops import sparse_verify_packed  # noqa: E402
from kernels.sparse_verify.reference import sparse_verify_packed_reference  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "window_tuning_probe", os.path.join(ROOT, "results/h200/window_tuning/probe.py"))
wt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wt)
wt.tuning_dict = lambda t: {} if t is None else dict(t)  # tunings given as dicts

U = dict(unroll=True)
WINDOW_TUNINGS = [
    None,
    dict(U, block_w=128, splits=8), dict(U, block_w=128, splits=8, num_warps=8),
    dict(U, block_w=128, splits=4), dict(U, block_w=128, splits=4, num_warps=8),
    dict(U, block_w=64, splits=8), dict(U, block_w=64, splits=8, num_warps=8),
    dict(block_w=128, splits=4, prefetch=False, num_stages=4),
]
LISTED_TUNINGS = [
    None,
    dict(U, block_w=64), dict(U, block_w=64, num_warps=8), dict(U, block_w=32),
    dict(U, block_w=64, splits=8),
]
LAYERS, CONTEXT = 8, 32768


def measure_listed(b, t, k, tunings, copy_tbs, hkv=4, g=7, d=128):
  rng = np.random.default_rng(b + k)
  lengths = jnp.asarray(rng.integers(CONTEXT - 2048, CONTEXT - 8, b), jnp.int32)
  s = CONTEXT + 64
  keys = jax.random.split(jax.random.key(b * 3 + k), 4)
  kcs = [jax.random.normal(kk, (b, hkv, s, d), jnp.bfloat16)
         for kk in jax.random.split(keys[0], LAYERS)]
  vcs = [jax.random.normal(kk, (b, hkv, s, d), jnp.bfloat16)
         for kk in jax.random.split(keys[1], LAYERS)]
  qkv = jax.random.normal(keys[2], (LAYERS, b, t, hkv, g + 2, d), jnp.bfloat16)
  idx = jnp.asarray(np.sort(np.stack([rng.choice(int(n), k, replace=False)
                                       for n in np.asarray(lengths)]), axis=-1), jnp.int32)
  cos, sin = wt.tables(lengths, t, d)
  want, wk, wv = sparse_verify_packed_reference(qkv[0], kcs[0], vcs[0], lengths, idx, cos, sin)
  read_bytes = b * hkv * (k + t) * d * 2 * 2
  base = dict(kind="listed", batch=b, t=t, k=k, kv_heads=hkv, group=g, head_dim=d,
              context=CONTEXT, read_bytes=read_bytes)
  run = lambda qkv, kc, vc, **kw: sparse_verify_packed(qkv, kc, vc, lengths, idx, cos, sin,
                                                       impl="gpu", **kw)
  return wt.time_tunings(base, tunings, run, (want, wk, wv), kcs, vcs, qkv, copy_tbs)


def best(records, tol):
  ok = [r for r in records if r.get("us_per_call") and r.get("cache_max_abs_diff", 1) < tol
        and r.get("max_abs_diff_out", 1) < tol]
  r = min(ok, key=lambda r: r["us_per_call"], default=None)
  return None if r is None else dict(tuning=r["tuning"], us_per_call=r["us_per_call"])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  copy_tbs = wt.copy_bandwidth()
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layers=LAYERS,
                copy_tbs=copy_tbs, records=[])
  print(json.dumps({k: v for k, v in result.items() if k != "records"}), flush=True)
  win1, listed, win2 = [], [], []

  def save():  # after each stage: a run cut short keeps what it measured
    result["records"] = win1 + listed + win2
    result["seconds"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "probe.json"), "w") as f:
      json.dump(result, f, indent=1)
    chosen = dict(window=best(win1, 0.02), listed=best(listed, 0.05))
    with open(os.path.join(args.out, "best.json"), "w") as f:
      json.dump(chosen, f, indent=1)
    print("best", json.dumps(chosen), flush=True)

  win1 += wt.measure(16, 2032, 1, WINDOW_TUNINGS, copy_tbs)
  save()
  listed += measure_listed(16, 5, 512, LISTED_TUNINGS, copy_tbs)
  save()
  win2 += wt.measure(16, 2032, 2, WINDOW_TUNINGS[:4], copy_tbs)
  save()


if __name__ == "__main__":
  main()
