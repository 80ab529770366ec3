r"""Benchmark of the verify-attention kernels (one layer, T verify tokens).

Times, in one process and with the copy bandwidth measured in the same run:
  decode_attention        our full-cache split-K kernel (the baseline)
  sparse_verify           our gathered attention, per budget K
  xla_reference           decode_attention's jnp reference under jit
  jax_pallas_gqa          jax's own Pallas GPU decode attention (1 query);
  jax_pallas_gqa_T5_packed  same op with the T queries folded into the head
                          axis (non-causal inside the block: timing only)
  srh_scores, topk, srh_scores+topk  importance estimation on n SRH heads
  copy                    jnp copy of a large array (bytes read + written)

Each timed call is one jit holding `inner` independent calls of the kernel
(different queries / indices / cache copies, so nothing is cached or
CSE'd); the median over `repeats` of that call, divided by `inner`, is the
wall time per kernel call (`wall_ms`, with block_until_ready; it includes the
host's dispatch of the jit, tens of microseconds, which swamps the small
sparse kernels).  On GPU the same call is then run once under the JAX
profiler and the GPU kernel intervals in its trace give `gpu_ms` (union of
kernel execution intervals, per call: all kernels the op launches, XLA
fusions included) and `gpu_span_ms` (first kernel start to last kernel end,
per call: adds the launch gaps inside the jit).  `ms` = gpu_ms where
available, else wall_ms; speedups are ratios of `ms` within one run.  Writes <out_dir>/<json_name>
(a list of records) and a PNG plot, and prints a table.

  python -m scripts.bench_attention --out_dir=results/h200
  python -m scripts.bench_attention --smoke --out_dir=/tmp/b   # CPU, tiny
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import os
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from scripts.benchmarking import (DeviceTimer, compile_cache_from_flag, median_seconds, pyplot,
                                  save_figure, write_json)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "results/h200", "where JSON and PNG go")
flags.DEFINE_string("json_name", "attention.json", "JSON file name")
flags.DEFINE_list("models", ["qwen2.5-7b", "llama3-8b", "qwen2.5-72b"],
                  "layer shapes to run")
flags.DEFINE_list("contexts", ["32768", "16384", "8192"], "context lengths")
flags.DEFINE_list("batches", ["16", "8", "1"], "batch sizes")
flags.DEFINE_list("budgets", ["256", "512", "1024", "2048"], "sparse budgets K")
flags.DEFINE_list("kernels", ["decode", "sparse", "xla", "jax_gqa", "srh"],
                  "which kernels")
flags.DEFINE_list("budget_shapes", [], "'ctx:batch' pairs where sparse_verify runs every "
                  "budget, elsewhere only 512 (default: the largest context x batch)")
flags.DEFINE_list("srh_models", ["qwen2.5-7b"], "models for the srh estimate")
flags.DEFINE_list("srh_budgets", ["512", "2048"], "top-k sizes for the srh "
                  "estimate at the largest shape (512 elsewhere)")
flags.DEFINE_list("secondary_kernels", ["decode", "sparse"], "kernels run "
                  "at shapes other than the largest context x batch (sparse "
                  "there only at K=512)")
flags.DEFINE_bool("device_time", True, "also time kernels from a profiler "
                  "trace (CUPTI kernel intervals; GPU only) and use it as ms")
flags.DEFINE_bool("check", True, "compare outputs with the references at "
                  "the largest shapes")
flags.DEFINE_integer("T", 5, "verify tokens (gamma + 1)")
flags.DEFINE_integer("inner", 16, "kernel calls per timed jit call")
flags.DEFINE_integer("repeats", 10, "timed calls (median)")
flags.DEFINE_integer("warmup", 2, "untimed calls after compilation")
flags.DEFINE_bool("ragged", True, "add a ragged-lengths variant at the "
                  "largest context and batch")
flags.DEFINE_bool("smoke", False, "tiny shapes, reference impl (CPU test)")
flags.DEFINE_bool("tune", False, "sweep kernel tuning at 7B, 16 x 32k first")
flags.DEFINE_float("time_limit_s", 0.0, "stop starting new measurements "
                   "after this many seconds (0 = no limit)")
flags.DEFINE_list("merge", [], "only merge these JSON files (plus out_dir's "
                  "json_name if present) into json_name and plot")
flags.DEFINE_string("impl", "auto", "impl for our kernels")

MODELS = {  # name: (Hq, Hkv, D)
    "qwen2.5-7b": (28, 4, 128),
    "llama3-8b": (32, 8, 128),
    "qwen2.5-72b": (64, 8, 128),
    "tiny": (4, 2, 16),
}
L2_BYTES = 60 * 2**20
N_LAYERS_7B = 28
SRH_HEADS = {  # kv-head layouts of the 4 SRH query heads (7B: G=7)
    "4q/4kv": lambda G: (0, G, 2 * G, 3 * G),
    "4q/2kv": lambda G: (0, 1, G, G + 1),
}
# --smoke: tiny shapes and few calls, on the reference kernels (CPU)
SMOKE = dict(models=["tiny"], contexts=["64"], batches=["2"], budgets=["8", "16"],
             srh_models=["tiny"], srh_budgets=["8"], inner=2, repeats=2, warmup=1, T=3)


class Bench:

  def __init__(self):
    self.records = []
    self.errors = []
    self.t0 = time.perf_counter()
    self.dtype = jnp.float32 if FLAGS.smoke else jnp.bfloat16
    self.itemsize = jnp.dtype(self.dtype).itemsize
    dev = jax.devices()[0]
    self.device = getattr(dev, "device_kind", str(dev))
    self.platform = jax.default_backend()
    self.copy_bw = None
    self.decode_ms = {}
    self.pending = []
    self.last_out = None
    self.best = {}

  # ------------------------------------------------------------ helpers
  def out_of_time(self):
    return FLAGS.time_limit_s and time.perf_counter() - self.t0 > FLAGS.time_limit_s

  def time_calls(self, fn, argsets, rec=None):
    """Median wall ms per kernel call over `argsets` (one jit, len(argsets)
    calls).  With `rec`, queues the record for device timing (flush)."""
    f = jax.jit(lambda sets: [fn(*a) for a in sets])
    out = jax.block_until_ready(f(argsets))
    s, _ = median_seconds(lambda: f(argsets), FLAGS.warmup, FLAGS.repeats)
    ms = s / len(argsets) * 1e3
    if rec is not None:
      rec["wall_ms"] = ms
      rec["ms"] = ms
      self.pending.append(dict(rec=rec, f=f, argsets=argsets))
    self.last_out = out[0]
    return ms

  def device_times(self, items):
    """(gpu_ms, gpu_span_ms) per call for each item, from one profiler trace."""
    with DeviceTimer() as t:
      for it in items:
        with t.window("item"):
          jax.block_until_ready(it["f"](it["argsets"]))
    return t.times("item", [len(it["argsets"]) for it in items])

  def flush(self):
    """Device-times the queued measurements, then records them in order."""
    items, self.pending = self.pending, []
    if not items:
      return
    times = [(None, None)] * len(items)
    if FLAGS.device_time and self.platform == "gpu":
      try:
        times = self.device_times(items)
      except Exception as e:  # keep the wall times
        self.errors.append(f"device_times: {type(e).__name__}: {e}")
        print("  device timing failed:", e, flush=True)
    for it, (busy, span) in zip(items, times):
      rec = it["rec"]
      rec["gpu_ms"], rec["gpu_span_ms"] = busy, span
      if busy:
        rec["ms"] = busy
      self.add(**rec)

  def measure_copy(self):
    """The copy bandwidth every kernel's `bw_share` is a share of (`add`)."""
    n = (2**22 if FLAGS.smoke else 2**30) // 2  # elements of bf16 (2 GiB)
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32).astype(
        jnp.bfloat16)
    rec = dict(kernel="copy", model=None, batch=None, context=None,
               budget=None, bytes=2 * x.nbytes, bytes_moved=2 * x.nbytes)
    self.time_calls(lambda a: jnp.copy(a), [(x,)] * 2, rec)
    self.flush()

  def add(self, **rec):
    ms = rec["ms"]
    if rec["kernel"] == "copy":
      # wall and device time agree for 2 GiB; ms is the device time when
      # there is one (same basis as the kernels' ms)
      self.copy_bw = rec["bytes"] / (ms * 1e-3) / 1e12
    rec.setdefault("ragged", False)
    rec.setdefault("T", FLAGS.T)
    rec.update(device=self.device, platform=self.platform,
               jax_version=jax.__version__, copy_bw_tbs=self.copy_bw,
               dtype=str(jnp.dtype(self.dtype)))
    rec["bw_tbs"] = rec["bytes"] / (ms * 1e-3) / 1e12
    rec["bw_share"] = rec["bw_tbs"] / self.copy_bw if self.copy_bw else None
    key = (rec.get("model"), rec.get("batch"), rec.get("context"),
           rec.get("ragged"))
    if rec["kernel"] == "decode_attention" and "tune" not in rec:
      self.decode_ms[key] = ms
    base = self.decode_ms.get(key)
    rec["speedup_vs_decode_attention"] = base / ms if base else None
    if rec["kernel"].startswith("srh_scores+") and base:
      rec["ratio_vs_28x_decode"] = ms / (N_LAYERS_7B * base)
    self.records.append(rec)
    self.save()
    print(f"  {rec['kernel']:<26} {str(rec.get('model')):<12} "
          f"B={rec.get('batch')} ctx={rec.get('context')} K={rec.get('budget')} "
          f"{ms:9.4f} ms  bw={rec['bw_share'] if rec['bw_share'] is None else round(rec['bw_share'], 3)}"
          f"  x{rec['speedup_vs_decode_attention'] and round(rec['speedup_vs_decode_attention'], 2)}",
          flush=True)
    return rec

  def save(self):
    write_json(os.path.join(FLAGS.out_dir, FLAGS.json_name), self.records)

  def guard(self, what, fn):
    if self.out_of_time():
      return None
    try:
      return fn()
    except Exception as e:  # keep going: one failing config is a record
      msg = f"{what}: {type(e).__name__}: {str(e)[:300]}"
      print("  ERROR", msg, flush=True)
      traceback.print_exc(limit=3)
      self.errors.append(msg)
      return None

  # ------------------------------------------------------------ data
  def make_shape(self, model, B, ctx, ragged=False, seed=0):
    Hq, Hkv, D = MODELS[model]
    T = FLAGS.T
    # Headroom past the context; a multiple of 2048 keeps jax's op happy
    # (its k_splits=16 x block_k=128 must divide S).
    S = ctx + (8 if FLAGS.smoke else 2048)
    cache_bytes = 2 * B * Hkv * S * D * self.itemsize
    n_copies = int(min(FLAGS.inner, max(1, math.ceil(4 * L2_BYTES / cache_bytes))))
    key = jax.random.PRNGKey(seed)
    caches = []
    for c in range(n_copies):
      kk, kv, key = jax.random.split(key, 3)
      k = jax.random.normal(kk, (B, Hkv, S, D), self.dtype)
      v = jax.random.normal(kv, (B, Hkv, S, D), self.dtype)
      caches.append((k, v))
    if ragged:
      rng = np.random.default_rng(seed)
      lengths = rng.integers(ctx // 8, ctx + 1, size=B).astype(np.int32)
    else:
      lengths = np.full((B,), ctx, np.int32)
    qs = []
    for i in range(FLAGS.inner):
      kq, key = jax.random.split(key)
      qs.append(jax.random.normal(kq, (B, T, Hq, D), self.dtype))
    return dict(model=model, B=B, ctx=ctx, S=S, Hq=Hq, Hkv=Hkv, D=D, T=T,
                caches=caches, qs=qs, lengths_np=lengths,
                lengths=jnp.asarray(lengths), ragged=ragged)

  def make_indices(self, sh, K, seed):
    rng = np.random.default_rng(seed)
    B = sh["B"]
    out = []
    for i in range(FLAGS.inner):
      idx = np.full((B, K), -1, np.int32)
      for b in range(B):
        L = int(sh["lengths_np"][b])
        n = min(K, L)
        idx[b, :n] = np.sort(rng.choice(L, size=n, replace=False))
      out.append(jnp.asarray(idx))
    return out

  def argsets(self, sh, extra=None):
    sets = []
    for i in range(FLAGS.inner):
      k, v = sh["caches"][i % len(sh["caches"])]
      a = [sh["qs"][i], k, v, sh["lengths"]]
      if extra is not None:
        a.append(extra[i])
      sets.append(tuple(a))
    return sets

  def live_kv_bytes(self, sh):
    rows = np.minimum(sh["lengths_np"] + sh["T"], sh["S"]).sum()
    return int(2 * rows * sh["Hkv"] * sh["D"] * self.itemsize)

  def qo_bytes(self, sh):
    return 2 * sh["B"] * sh["T"] * sh["Hq"] * sh["D"] * self.itemsize

  def base(self, sh, **kw):
    d = dict(model=sh["model"], batch=sh["B"], context=sh["ctx"],
             ragged=sh["ragged"], Hq=sh["Hq"], Hkv=sh["Hkv"], D=sh["D"],
             budget=None)
    d.update(kw)
    return d

  # ------------------------------------------------------------ kernels
  def rel_err(self, out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
      return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))

  def run_decode(self, sh, tune=None, tag=None, check=False):
    from kernels.decode_attention.ops import decode_attention
    tuning = dict(tune or {})
    fn = functools.partial(decode_attention, impl=FLAGS.impl, **tuning)
    floor = self.live_kv_bytes(sh) + self.qo_bytes(sh)
    rec = self.base(sh, kernel="decode_attention", bytes=floor,
                    bytes_moved=floor + self.decode_partial_bytes(sh, tuning),
                    tuning=tuning)
    if tag:
      rec["tune"] = tag
    self.time_calls(fn, self.argsets(sh), rec)
    if check:
      sh["decode_out0"] = (rec, self.last_out)

  def decode_partial_bytes(self, sh, tuning):
    if self.platform != "gpu" or FLAGS.impl not in ("auto", "gpu"):
      return 0
    from kernels.decode_attention.gpu import default_tuning
    t = default_tuning(sh["B"], sh["Hkv"], sh["S"], sh["T"],
                       sh["Hq"] // sh["Hkv"], sh["D"], self.dtype)
    t.update({k: v for k, v in tuning.items() if v})
    chunk = t["chunk"]
    if math.ceil(sh["S"] / chunk) == 1:
      return 0
    live = np.ceil(np.minimum(sh["lengths_np"] + sh["T"], sh["S"]) / chunk)
    rows = sh["T"] * sh["Hq"]
    return int(2 * live.sum() * rows * (sh["D"] + 2) * 4)

  def run_sparse(self, sh, K, tune=None, tag=None, check=False):
    from kernels.sparse_verify.ops import sparse_verify
    tuning = dict(tune or {})
    key = ("idx", K)
    if key not in sh:
      sh[key] = self.make_indices(sh, K, seed=K)
    idx = sh[key]
    fn = functools.partial(sparse_verify, impl=FLAGS.impl, **tuning)
    n_valid = int((np.asarray(idx[0]) >= 0).sum())
    rows = n_valid + sh["B"] * sh["T"]
    floor = (2 * rows * sh["Hkv"] * sh["D"] * self.itemsize + self.qo_bytes(sh)
             + sh["B"] * K * 4)
    rec = self.base(sh, kernel="sparse_verify", budget=K, bytes=floor,
                    bytes_moved=floor, tuning=tuning)
    if tag:
      rec["tune"] = tag
    sets = self.argsets(sh, idx)
    self.time_calls(fn, sets, rec)
    if check:
      from kernels.sparse_verify.reference import sparse_verify_reference
      ref = jax.jit(sparse_verify_reference)(*sets[0])
      rec["rel_err_vs_reference"] = self.rel_err(self.last_out, ref)

  def run_xla(self, sh):
    from kernels.decode_attention.reference import decode_attention_reference
    floor = self.live_kv_bytes(sh) + self.qo_bytes(sh)
    rec = self.base(sh, kernel="xla_reference", bytes=floor, bytes_moved=None)
    self.time_calls(decode_attention_reference, self.argsets(sh), rec)
    if "decode_out0" in sh:
      drec, dout = sh.pop("decode_out0")
      drec["rel_err_vs_reference"] = self.rel_err(dout, self.last_out)

  def run_jax_gqa(self, sh, packed):
    """jax.experimental.pallas.ops.gpu.decode_attention on head-major K/V."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jda
    B, Hq, Hkv, D, T = sh["B"], sh["Hq"], sh["Hkv"], sh["D"], sh["T"]
    G = Hq // Hkv
    rows = G * T if packed else G
    params = inspect.signature(jda.decode_attn_unbatched).parameters
    kw = dict(sm_scale=1 / math.sqrt(D), block_h=16, block_k=128,
              k_splits=16, num_warps=None, num_stages=2, grid=None,
              interpret=False, debug=False, return_residuals=False,
              normalize_output=True)
    kw = {k: v for k, v in kw.items() if k in params}
    inner = functools.partial(jda.decode_attn_unbatched, **kw)

    def fn(q, k, v, lengths):
      # q: [B, T, Hq, D] -> [B, Hkv, rows, D]; rows = G (token 0) or T*G.
      if packed:
        qq = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)
        qq = qq.reshape(B, Hkv, T * G, D)
      else:
        qq = q[:, 0].reshape(B, Hkv, G, D)
      seq = jnp.broadcast_to((lengths + T)[:, None], (B, Hkv))
      return jax.vmap(jax.vmap(inner, in_axes=(0, 0, 0, None, 0)),
                      in_axes=(0, 0, 0, None, 0))(qq, k, v, None, seq)

    floor = self.live_kv_bytes(sh) + 2 * B * rows * Hkv * D * self.itemsize
    name = "jax_pallas_gqa_T5_packed" if packed else "jax_pallas_gqa"
    rec = self.base(
        sh, kernel=name, bytes=floor, bytes_moved=None,
        note=("T queries folded into heads, no causal mask inside the block"
              if packed else "1 query per head (the op cannot take T>1)"))
    self.time_calls(fn, self.argsets(sh), rec)

  def run_srh(self, sh, layout, budgets):
    from kernels.srh_scores.ops import select_topk, srh_scores, srh_scores_bytes
    B, T, D, G = sh["B"], sh["T"], sh["D"], sh["Hq"] // sh["Hkv"]
    kv_head = tuple(h // G for h in SRH_HEADS[layout](G))
    nq = len(kv_head)
    key = jax.random.PRNGKey(7)
    qsets = []
    for i in range(FLAGS.inner):
      key, kq = jax.random.split(key)
      k, _ = sh["caches"][i % len(sh["caches"])]
      qsets.append((jax.random.normal(kq, (B, T, nq, D), self.dtype), k,
                    sh["lengths"]))
    scores_fn = functools.partial(srh_scores, kv_head=kv_head, impl=FLAGS.impl)
    S_live = int(np.minimum(sh["lengths_np"] + T, sh["S"]).max())
    by = srh_scores_bytes(B, S_live, D, kv_head, T, self.itemsize)
    note = f"{nq} SRH query heads on {len(set(kv_head))} KV heads {kv_head}"
    rec = self.base(sh, kernel="srh_scores", srh_layout=layout,
                    bytes=by["keys"] + by["scores"], bytes_moved=by["total"],
                    note=note)
    self.time_calls(lambda q, k, L: scores_fn(q, k, L), qsets, rec)
    scores = [jax.random.uniform(jax.random.PRNGKey(i), (B, sh["S"]))
              for i in range(FLAGS.inner)]
    for K in budgets:
      for method in ("lax", "two_stage"):
        if method == "two_stage" and sh["S"] <= max(4 * K, 2048):
          continue
        name = "topk" if method == "lax" else "topk_two_stage"
        sel = functools.partial(select_topk, k=K, method=method)
        rec = self.base(sh, kernel=name, budget=K, bytes=B * sh["S"] * 4,
                        bytes_moved=None)
        self.time_calls(lambda s: sel(s), [(s,) for s in scores], rec)
        rec = self.base(sh, kernel=f"srh_scores+{name}", budget=K,
                        srh_layout=layout, bytes=by["keys"] + by["scores"],
                        bytes_moved=by["total"], note=note)
        self.time_calls(lambda q, k, L: sel(scores_fn(q, k, L)), qsets, rec)

  # ------------------------------------------------------------ plans
  DECODE_SWEEP = [dict(block_k=64, chunk=2048), dict(block_k=64, chunk=8192),
                  dict(block_k=32, chunk=4096, num_stages=4)]
  SPARSE_SWEEP = [  # on top of the default (block_k=64, ~2 programs/SM, xla)
      dict(block_k=64, target_programs=64),
      dict(block_k=64, target_programs=64, num_stages=4),
      dict(block_k=64, target_programs=132),
      dict(block_k=64, target_programs=396),
      dict(block_k=64, target_programs=264, combine="fused"),
      dict(block_k=64, target_programs=396, combine="fused"),
      dict(block_k=32, target_programs=528),
      dict(block_k=32, target_programs=528, combine="fused"),
      dict(block_k=128, target_programs=320, num_stages=2),
  ]

  def tune(self):
    sh = self.make_shape("qwen2.5-7b", 16, 32768)
    print("== tuning at qwen2.5-7b B=16 ctx=32768", flush=True)
    self.guard("decode default", lambda: self.run_decode(sh, tag="default"))
    for t in self.DECODE_SWEEP:
      self.guard(f"decode {t}", lambda: self.run_decode(sh, t, tag="tune"))
    self.guard("sparse default", lambda: self.run_sparse(sh, 512,
                                                         tag="default"))
    for t in self.SPARSE_SWEEP:
      self.guard(f"sparse {t}", lambda: self.run_sparse(sh, 512, t,
                                                        tag="tune"))
    n0 = len(self.records)
    self.guard("flush", self.flush)
    cands = [r for r in self.records[n0:] if r["kernel"] == "sparse_verify"]
    if cands:
      best = min(cands, key=lambda r: r["ms"])
      self.best["sparse_verify"] = dict(best.get("tuning") or {})
      print(f"  best sparse_verify: {self.best['sparse_verify']} {best['ms']:.4f} ms",
            flush=True)
    del sh

  def grid(self):
    models = FLAGS.models
    ctxs = [int(c) for c in FLAGS.contexts]
    batches = [int(b) for b in FLAGS.batches]
    budgets = [int(k) for k in FLAGS.budgets]
    shapes = [(m, c, b) for c in ctxs for b in batches for m in models]
    # Priority: the largest context x batch first for every model, then the
    # ragged variants, then the rest (7B first).
    shapes.sort(key=lambda s: (-(s[1] * s[2]), models.index(s[0])))
    primary = [s for s in shapes if s[1] == max(ctxs) and s[2] == max(batches)]
    rest = [s for s in shapes if s not in primary]
    rest.sort(key=lambda s: (models.index(s[0]), -(s[1] * s[2])))
    jobs = [(m, c, b, False) for (m, c, b) in primary]
    if FLAGS.ragged and not FLAGS.smoke:
      jobs += [(m, c, b, True) for (m, c, b) in primary]
    jobs += [(m, c, b, False) for (m, c, b) in rest]
    sparse_tune = self.best.get("sparse_verify", {})
    for model, ctx, B, ragged in jobs:
      if self.out_of_time():
        print("time limit reached: stopping", flush=True)
        break
      print(f"== {model} B={B} ctx={ctx} ragged={ragged}", flush=True)
      sh = self.guard("alloc", lambda: self.make_shape(model, B, ctx, ragged))
      if sh is None:
        continue
      is_primary = (ctx == max(ctxs) and B == max(batches))
      ks = FLAGS.kernels if (is_primary and not ragged) else [
          k for k in FLAGS.kernels if k in FLAGS.secondary_kernels]
      check = FLAGS.check and is_primary
      if "decode" in ks:
        self.guard("decode", lambda: self.run_decode(sh, check=check))
      if "sparse" in ks:
        every_budget = (f"{ctx}:{B}" in FLAGS.budget_shapes if FLAGS.budget_shapes
                        else is_primary)
        kset = budgets if (every_budget and not ragged) else (
            [k for k in budgets if k == 512] or budgets[:1])
        for K in kset:
          self.guard(f"sparse K={K}", lambda: self.run_sparse(
              sh, K, sparse_tune, check=check and K == 512))
      if "xla" in ks:
        self.guard("xla", lambda: self.run_xla(sh))
      if "jax_gqa" in ks and self.platform == "gpu":
        self.guard("jax_gqa", lambda: self.run_jax_gqa(sh, packed=False))
        self.guard("jax_gqa_packed", lambda: self.run_jax_gqa(sh, packed=True))
      if "srh" in ks and model in FLAGS.srh_models:
        kset = [int(k) for k in FLAGS.srh_budgets]
        if not is_primary:
          kset = [k for k in kset if k == 512] or kset[:1]
        for layout in SRH_HEADS:
          if FLAGS.smoke and layout != "4q/2kv":
            continue
          self.guard(f"srh {layout}", lambda: self.run_srh(sh, layout, kset))
      self.guard("flush", self.flush)
      del sh


def print_table(records):
  rows = [r for r in records if r["kernel"] != "copy" and not r.get("tune")]
  tunes = [r for r in records if r.get("tune")]
  if tunes:
    print("\ntuning sweep (qwen2.5-7b, B=16, ctx=32768, sparse K=512):")
    for r in tunes:
      print(f"  {r['kernel']:<18}{r['tune']:<8}{r['ms']:>9.4f} ms "
            f"(wall {r.get('wall_ms') or r['ms']:.4f})  {r.get('tuning')}")
  copy = [r for r in records if r["kernel"] == "copy"]
  if copy:
    print(f"\ncopy bandwidth: {copy[0]['bw_tbs']:.3f} TB/s  "
          f"({copy[0]['device']}, jax {copy[0]['jax_version']})")
  hdr = (f"{'kernel':<26}{'model':<13}{'B':>3}{'ctx':>7}{'K':>6}{'rag':>4}"
         f"{'ms':>10}{'wall_ms':>9}{'TB/s':>7}{'bw%':>6}{'x dec':>8}")
  print(hdr)
  for r in rows:
    sp = r.get("speedup_vs_decode_attention")
    bw = r.get("bw_share")
    extra = ""
    if r.get("ratio_vs_28x_decode") is not None:
      extra = f"  {100 * r['ratio_vs_28x_decode']:.2f}% of 28xdecode"
    if r.get("srh_layout"):
      extra += f" [{r['srh_layout']}]"
    if r.get("rel_err_vs_reference") is not None:
      extra += f" err={r['rel_err_vs_reference']:.1e}"
    print(f"{r['kernel']:<26}{str(r['model']):<13}{r['batch']:>3}"
          f"{r['context']:>7}{str(r.get('budget') or '-'):>6}"
          f"{'y' if r.get('ragged') else '':>4}{r['ms']:>10.4f}"
          f"{r.get('wall_ms') or r['ms']:>9.4f}"
          f"{r['bw_tbs']:>7.2f}{(100 * bw if bw else 0):>6.1f}"
          f"{(sp or 0):>8.2f}{extra}")


def plot(records, path):
  recs = [r for r in records if r["kernel"] != "copy" and not r.get("tune")
          and not r.get("ragged")]
  if not recs:
    return
  models = sorted({r["model"] for r in recs}, key=str)
  fig, axes = pyplot().subplots(1, 3, figsize=(17, 4.8))
  # (a) full-cache kernels: bandwidth share at the largest batch
  ax = axes[0]
  bmax = max(r["batch"] for r in recs)
  full = ("decode_attention", "xla_reference", "jax_pallas_gqa",
          "jax_pallas_gqa_T5_packed")
  ctxs = sorted({r["context"] for r in recs if r["kernel"] in full
                 and r["batch"] == bmax})
  if len(ctxs) > 1:
    for kern, ls in zip(full, ("-", ":", "--", "-.")):
      for m in models:
        pts = sorted((r["context"], r["bw_share"]) for r in recs
                     if r["kernel"] == kern and r["model"] == m
                     and r["batch"] == bmax and r["bw_share"])
        if pts:
          ax.plot(*zip(*pts), ls, marker="o", label=f"{kern} {m}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context")
    ax.legend(fontsize=6)
  else:
    width = 0.8 / len(full)
    for i, kern in enumerate(full):
      vals = [next((r["bw_share"] for r in recs if r["kernel"] == kern
                    and r["model"] == m and r["batch"] == bmax), 0) or 0
              for m in models]
      ax.bar([x + i * width for x in range(len(models))], vals, width,
             label=kern)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(models))])
    ax.set_xticklabels(models, fontsize=8)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
  ax.axhline(0.85, color="gray", lw=0.8)
  ax.set_ylabel("share of copy bandwidth (read+write copy)")
  ax.set_title(f"full-cache verify attention, B={bmax}, "
               f"ctx={'/'.join(str(c) for c in ctxs)}")
  # (b) sparse speedup vs budget at the largest context x batch
  ax = axes[1]
  cmax = max(r["context"] for r in recs)
  for m in models:
    pts = sorted((r["budget"], r["speedup_vs_decode_attention"]) for r in recs
                 if r["kernel"] == "sparse_verify" and r["model"] == m
                 and r["batch"] == bmax and r["context"] == cmax
                 and r["speedup_vs_decode_attention"])
    if pts:
      ax.plot(*zip(*pts), marker="o", label=m)
  ax.axhline(40, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("budget K")
  ax.set_ylabel("speedup vs decode_attention")
  ax.set_title(f"sparse_verify, B={bmax}, ctx={cmax}")
  ax.legend(fontsize=7)
  # (c) ms of every kernel at the largest shape per model
  ax = axes[2]
  labels, vals = [], []
  for m in models:
    for r in recs:
      if (r["model"] == m and r["batch"] == bmax and r["context"] == cmax
          and r["kernel"] not in ("topk",)
          and (r.get("budget") in (None, 512))):
        lab = r["kernel"] + (f" [{r['srh_layout']}]" if r.get("srh_layout") else "")
        labels.append(f"{m}: {lab}")
        vals.append(r["ms"])
  ax.barh(range(len(vals)), vals)
  ax.set_yticks(range(len(vals)))
  ax.set_yticklabels(labels, fontsize=6)
  ax.set_xscale("log")
  ax.set_xlabel("ms (log)")
  ax.set_title(f"time per layer call, B={bmax}, ctx={cmax}, K=512")
  save_figure(fig, path)


def main(argv):
  del argv
  compile_cache_from_flag()
  if FLAGS.smoke:
    for name, value in SMOKE.items():
      setattr(FLAGS, name, value)
  json_path = os.path.join(FLAGS.out_dir, FLAGS.json_name)
  png_path = os.path.splitext(json_path)[0] + ".png"
  if FLAGS.merge:
    records = []
    for p in FLAGS.merge:
      with open(p) as f:
        records += json.load(f)
    write_json(json_path, records)
    print_table(records)
    plot(records, png_path)
    return
  b = Bench()
  print(f"device {b.device}  jax {jax.__version__}", flush=True)
  b.measure_copy()
  print(f"copy bandwidth {b.copy_bw:.3f} TB/s", flush=True)
  if FLAGS.tune:
    b.tune()
  b.grid()
  b.guard("flush", b.flush)
  b.save()
  print_table(b.records)
  plot(b.records, png_path)
  if b.errors:
    print(f"\n{len(b.errors)} errors:")
    for e in b.errors:
      print(" ", e)


if __name__ == "__main__":
  app.run(main)
