"""Probe: are XLA's autotuned GEMMs right for the step's few-row projections,
whose weights come from HBM, not L2?

XLA's GEMM autotuner times each candidate on one set of operands, a warm-up
run and then a timed run on the same buffers (xla/backends/gpu/autotuner/
gpu_profiler.cc), so a weight that fits in L2 (the 7B's o, 25.7 MB, and
q/k/v, 33 MB; every draft weight) is timed from L2. In the step each
layer's weight is read once per pass, from HBM. This times chains of L
layers (each product's output the next one's input) over L distinct weights
(cold: more bytes than L2 holds, as in the step) and over one weight used L
times (warm: what the autotuner sees), for

  xla      XLA's own pick;
  cublas   cuBLAS only (`xla_gpu_enable_triton_gemm=false`);
  bM_nN_kK_sS_stT_wW   one Triton config forced: the autotuner's override
           file holding only it, cuBLAS fallback off.

Per variant: GPU us per layer (busy time of the chain / L, median of the
repeats), the kernels it ran, and the GEMM config XLA compiled (read from
the optimised HLO). `--mode=dump` compiles the q/k/v chain with XLA's
autotune-results dump and its cache directories (the route by which a
config could be handed to XLA per fusion); `--mode=load FILE` compiles it
with the results file FILE edited to a forced config, and reports what XLA
compiled.

Measured on an H100: results/h100/gemm_l2/ (the forced configs were not
applied by jax 0.11.2's autotuner; cuBLAS with its epilogue fused beats
XLA's pick for the verify's two by 1.6 us a call, not for the draft's).

Usage (repository root): python results/h200/gemm_l2/probe.py --mode=sweep
  --out=DIR [--budget_s=380]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from scripts.benchmarking import DeviceTimer, device_events, measure_copy_tbs  # noqa: E402

# name: (rows M, K, N, epilogue). Verify: 16 sequences x 5 tokens at the
# 7B; draft: 16 x 1 at the 0.5B. "bias": the q/k/v's f32 product + bias,
# cast; "residual": o's bf16 product added to its input.
SHAPES = {
    "v_qkv": (80, 3584, 4608, "bias"),
    "v_o": (80, 3584, 3584, "residual"),
    "d_qkv": (16, 896, 1152, "bias"),
    "d_o": (16, 896, 896, "residual"),
}
COLD_BYTES = 256 * 2**20  # weight bytes per cold chain (> 50-60 MB of L2)


def layer(x, w, b, epilogue):
  k = x.shape[1]
  if epilogue == "bias":
    y = (jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
         ).astype(x.dtype)
    # every column feeds the next layer (no slice XLA could sink into the dot)
    return y[:, :k] + y[:, y.shape[1] - k:]
  return x + jnp.dot(x, w, preferred_element_type=x.dtype)


def chain(x, ws, bs, epilogue, salt=0):
  """`salt` > 0 scales each layer's input by 1 + salt / 128 (fused into the
  GEMM's prologue): a fusion of its own, which XLA's in-process autotune
  cache (keyed by the fusion, not by the compile's options) has not seen."""
  for w, b in zip(ws, bs):
    if salt:
      x = x * jnp.asarray(1 + salt / 128, x.dtype)
    x = layer(x, w, b, epilogue)
  return x


def config_name(c):
  return "b{}_n{}_k{}_s{}_st{}_w{}".format(*c)


def override_text(c):
  bm, bn, bk, sk, st, nw = c
  return (f"config {{ block_m: {bm} block_n: {bn} block_k: {bk} split_k: {sk} "
          f"num_stages: {st} num_warps: {nw} num_ctas: 1 }}\n")


def compiled_gemms(hlo: str) -> list[str]:
  """The GEMM configs / library calls of an optimised HLO module."""
  found = set(re.findall(r'"triton_gemm_config":\{[^}]*\}', hlo))
  found |= {f"custom_call {t}" for t in re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo)}
  return sorted(s.replace('"', "") for s in found)


def stage1(m, k, n):
  """Coarse grid: block_k 128 (K 896: also 64, 256), 4 stages, 4 warps."""
  out = []
  bms = [16] if m <= 16 else [16, 32, 64, 128]
  bns = [16, 32, 64, 128] if m <= 16 else [32, 64, 128, 256]
  bks = [64, 128, 256] if k < 2048 else [128]
  lo, hi = (20, 400) if m <= 16 else (66, 800)
  for bm in bms:
    for bn in bns:
      for bk in bks:
        for sk in (1, 2, 4, 8, 16):
          ctas = math.ceil(m / bm) * math.ceil(n / bn) * sk
          if sk * bk <= k and lo <= ctas <= hi:
            out.append((bm, bn, bk, sk, 4, 4))
  return out


def stage2(best, k):
  """Around each of the best: one knob changed at a time."""
  out = []
  for bm, bn, bk, sk, st, nw in best:
    out += [(bm, bn, bk2, sk, st, nw) for bk2 in (64, 256) if bk2 != bk and sk * bk2 <= k]
    out += [(bm, bn, bk, sk, st2, nw) for st2 in (3, 5)]
    out.append((bm, bn, bk, sk, st, 8))
  return out


class Shape:

  def __init__(self, name, key):
    self.name = name
    m, k, n, self.epilogue = SHAPES[name]
    self.mkn = (m, k, n)
    wbytes = k * n * 2
    self.layers = max(8, math.ceil(COLD_BYTES / wbytes))
    kx, kw = jax.random.split(key)
    self.x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    self.ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * (0.5 / math.sqrt(k))
               for kk in jax.random.split(kw, self.layers)]
    self.bs = [jnp.zeros((n,), jnp.bfloat16)] * self.layers
    self.warm_ws = [self.ws[0]] * self.layers
    self.floor_us = None
    self.salts = 0

  def compile(self, options, salt=False):
    """The chain compiled with XLA `options`; `salt`: a fusion XLA has not
    autotuned in this process (so that the options decide its config)."""
    s = 0
    if salt:
      self.salts += 1
      s = self.salts
    fn = jax.jit(lambda x, ws, bs: chain(x, ws, bs, self.epilogue, s))
    return fn.lower(self.x, self.ws, self.bs).compile(compiler_options=options)

  def time(self, compiled, repeats=5):
    """{cold_us, warm_us, kernels {name: us per layer}} of a compiled chain."""
    res = {}
    for label, ws in (("cold", self.ws), ("warm", self.warm_ws)):
      jax.block_until_ready(compiled(self.x, ws, self.bs))
      with DeviceTimer() as t:
        for _ in range(repeats):
          with t.window(label):
            jax.block_until_ready(compiled(self.x, ws, self.bs))
      ms = t.ms(label)
      res[f"{label}_us"] = (statistics.median(ms) * 1e3 / self.layers) if ms else None
      if label == "cold":
        per = {}
        for e in device_events(t._ev):
          per[e["name"]] = per.get(e["name"], 0.0) + e.get("dur", 0) / (repeats * self.layers)
        res["kernels"] = {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    return res


def variant(shape, name, options, out, salt=False):
  t0 = time.time()
  try:
    c = shape.compile(options, salt)
    rec = dict(shape=shape.name, variant=name, compiled=compiled_gemms(c.as_text()),
               **shape.time(c))
  except Exception as e:  # a config XLA rejects: recorded, not fatal
    rec = dict(shape=shape.name, variant=name, error=f"{type(e).__name__}: {str(e)[:300]}")
  rec["compile_and_time_s"] = round(time.time() - t0, 1)
  if shape.floor_us and rec.get("cold_us"):
    rec["cold_share_of_copy_bw"] = round(shape.floor_us / rec["cold_us"], 3)
  out.append(rec)
  print(json.dumps({k: v for k, v in rec.items() if k != "kernels"}), flush=True)
  return rec


def sweep(args):
  recs = []
  copy_tbs = measure_copy_tbs()
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_tbs=copy_tbs,
              xla_flags=os.environ.get("XLA_FLAGS", ""))
  print(json.dumps(meta), flush=True)
  path = os.path.join(args.out, "sweep.json")
  tmp = tempfile.mkdtemp()
  key = jax.random.key(0)
  names = args.shapes.split(",")
  share = {"v_qkv": 0.32, "v_o": 0.32, "d_qkv": 0.18, "d_o": 0.18}
  for name in names:
    deadline = time.time() + args.budget_s * share.get(name, 1 / len(names))
    key, sk = jax.random.split(key)
    shape = Shape(name, sk)
    m, k, n = shape.mkn
    if copy_tbs:
      shape.floor_us = k * n * 2 / (copy_tbs * 1e12) * 1e6
    mine = []
    variant(shape, "xla", {}, mine)
    variant(shape, "xla_salted", {}, mine, salt=True)  # what the salt itself costs
    variant(shape, "cublas", {"xla_gpu_enable_triton_gemm": False}, mine)

    def forced(cfgs):
      for c in cfgs:
        if time.time() > deadline:
          return
        f = os.path.join(tmp, config_name(c) + ".txtpb")
        with open(f, "w") as fh:
          fh.write(override_text(c))
        variant(shape, config_name(c),
                {"xla_gpu_gemm_autotuner_override_file": f, "xla_gpu_cublas_fallback": False},
                mine, salt=True)

    first = stage1(m, k, n)
    forced(first)
    ranked = sorted((r for r in mine if r.get("cold_us") and r["variant"].startswith("b")),
                    key=lambda r: r["cold_us"])
    best = [tuple(int(v) for v in re.findall(r"\d+", r["variant"])) for r in ranked[:3]]
    done = {r["variant"] for r in mine}
    forced([c for c in stage2(best, k) if config_name(c) not in done])
    recs += mine
    del shape
    with open(path, "w") as fh:
      json.dump(dict(meta, records=recs), fh, indent=1)
  summary(recs)


def summary(recs):
  by = {}
  for r in recs:
    by.setdefault(r["shape"], []).append(r)
  for name, rs in by.items():
    ok = [r for r in rs if r.get("cold_us")]
    xla = next((r for r in rs if r["variant"] == "xla"), {})
    cold = sorted(ok, key=lambda r: r["cold_us"])[:3]
    warm = sorted(ok, key=lambda r: r["warm_us"])[:3]
    print(f"{name}: xla cold {xla.get('cold_us')} warm {xla.get('warm_us')} {xla.get('compiled')}")
    for r in cold:
      print(f"  best cold {r['variant']}: cold {r['cold_us']:.2f} warm {r['warm_us']:.2f}")
    for r in warm:
      print(f"  best warm {r['variant']}: cold {r['cold_us']:.2f} warm {r['warm_us']:.2f}")


def dump(args):
  """Compile the q/k/v chain with XLA's autotune dump and cache dirs set."""
  shape = Shape("v_qkv", jax.random.key(1))
  out = {}
  trials = {
      "dump_results": {"xla_gpu_dump_autotune_results_to": os.path.join(args.out, "dump.txtpb")},
      "per_fusion_dir": {"xla_gpu_per_fusion_autotune_cache_dir": os.path.join(args.out, "pf")},
      "autotuner_cache_dir": {
          "xla_gpu_experimental_autotuner_cache_dir": os.path.join(args.out, "ac"),
          "xla_gpu_experimental_autotune_cache_mode": "AUTOTUNE_CACHE_MODE_UPDATE"},
  }
  for name, opts in trials.items():
    try:
      c = shape.compile(opts)
      out[name] = dict(ok=True, compiled=compiled_gemms(c.as_text()))
    except Exception as e:
      out[name] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    jax.clear_caches()
  for root, _, files in os.walk(args.out):
    for f in files:
      out.setdefault("files", []).append(os.path.relpath(os.path.join(root, f), args.out))
  print(json.dumps(out, indent=1))
  with open(os.path.join(args.out, "dump.json"), "w") as fh:
    json.dump(out, fh, indent=1)


def edit_results(text: str, cfg) -> tuple[str, int]:
  """`text` (an AutotuneResults textproto) with the result of every entry
  whose fusion holds a dot replaced by Triton config `cfg`."""
  bm, bn, bk, sk, st, nw = cfg
  triton = (f"triton {{ block_m: {bm} block_n: {bn} block_k: {bk} split_k: {sk} "
            f"num_stages: {st} num_warps: {nw} num_ctas: 1 }}")
  n = 0

  def one(m):
    nonlocal n
    entry = m.group(0)
    if "dot(" not in entry:
      return entry
    new = re.sub(r"(gemm|triton) \{[^{}]*\}", triton, entry, count=1)
    n += new != entry
    return new

  return re.sub(r"results \{.*?\n\}", one, text, flags=re.S), n


def load(args):
  src = args.file
  cfg = tuple(int(v) for v in args.config.split(","))
  with open(src) as fh:
    text, n = edit_results(fh.read(), cfg)
  path = os.path.join(args.out, "edited.txtpb")
  with open(path, "w") as fh:
    fh.write(text)
  shape = Shape("v_qkv", jax.random.key(1))
  out = dict(edited_entries=n, config=config_name(cfg))
  try:
    c = shape.compile({"xla_gpu_load_autotune_results_from": path})
    out["compiled"] = compiled_gemms(c.as_text())
    out.update(shape.time(c))
  except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  print(json.dumps(out, indent=1))
  with open(os.path.join(args.out, "load.json"), "w") as fh:
    json.dump(out, fh, indent=1)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mode", choices=("sweep", "dump", "load"), default="sweep")
  p.add_argument("--out", default=".")
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--budget_s", type=float, default=380)
  p.add_argument("--file", default="")
  p.add_argument("--config", default="16,64,128,4,4,4")
  p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the probe)")
  args = p.parse_args()
  if args.smoke:
    global COLD_BYTES
    COLD_BYTES = 2**16
    for name, (m, k, n, e) in list(SHAPES.items()):
      SHAPES[name] = (m, k // 16, n // 16, e)
  os.makedirs(args.out, exist_ok=True)
  {"sweep": sweep, "dump": dump, "load": load}[args.mode](args)


if __name__ == "__main__":
  main()
