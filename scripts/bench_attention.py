r"""Benchmark of the verify-attention kernels (one layer, T verify tokens).

Times decode_attention (our full-cache split-K kernel, the baseline),
sparse_verify (our gathered attention) per budget K, a verify layer's whole
attention from its packed q/k/v projection (RoPE, cache writes, sparse_verify)
as one kernel (sparse_verify_packed), xla_reference
(decode_attention's jnp reference under jit) and the SRH importance estimate
(srh_scores, topk, topk_two_stage, srh_scores+topk[_two_stage]); first a jnp
copy, the bandwidth that every `bw_share` is a share of.  `wall_ms`: wall time
per kernel call, the host's dispatch included (tens of us: it swamps the small
kernels); `gpu_ms`: GPU kernel time per call from a profiler trace (GPU only);
`ms`: gpu_ms where there is one, else wall_ms, the basis of every ratio;
`bytes`: the kernel's floor of HBM traffic.  Writes <out_dir>/<json_name> (a
list of records), a PNG beside it, and prints a table.

  python -m scripts.bench_attention --out_dir=results/h200
  python -m scripts.bench_attention --smoke --out_dir=/tmp/b   # CPU, tiny
"""
from __future__ import annotations

import functools
import math
import os
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from kernels.decode_attention.ops import decode_attention
from kernels.decode_attention.reference import decode_attention_reference
from kernels.sparse_verify.ops import sparse_verify, sparse_verify_packed
from kernels.sparse_verify.reference import sparse_verify_reference
from kernels.srh_scores.ops import select_topk, srh_scores, srh_scores_bytes
from kernels.topk.ops import topk
from scripts.benchmarking import (DeviceTimer, compile_cache_from_flag, median_seconds, pyplot,
                                  save_figure, write_json)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "results/h200", "where JSON and PNG go")
flags.DEFINE_string("json_name", "attention.json", "JSON file name")
flags.DEFINE_list("models", ["qwen2.5-7b", "llama3-8b", "qwen2.5-72b"], "layer shapes to run")
flags.DEFINE_list("contexts", ["32768", "16384", "8192"], "context lengths")
flags.DEFINE_list("batches", ["16", "8", "1"], "batch sizes")
flags.DEFINE_list("budgets", ["256", "512", "1024", "2048"], "sparse budgets K")
KERNELS = ("decode", "sparse", "packed", "xla", "srh")
flags.DEFINE_list("kernels", list(KERNELS), f"which kernels, of {', '.join(KERNELS)}")
flags.register_validator("kernels", lambda ks: set(ks) <= set(KERNELS),
                         f"--kernels takes names of {', '.join(KERNELS)}")
flags.DEFINE_list("budget_shapes", [], "'ctx:batch' pairs where sparse_verify runs every "
                  "budget, elsewhere only 512 (default: the largest context x batch)")
flags.DEFINE_list("srh_models", ["qwen2.5-7b"], "models for the srh estimate")
flags.DEFINE_list("srh_budgets", ["512", "2048"], "top-k sizes for the srh estimate at the "
                  "largest shape (512 elsewhere)")
flags.DEFINE_list("secondary_kernels", ["decode", "sparse"], "kernels run at shapes other "
                  "than the largest context x batch (sparse there only at K=512)")
flags.DEFINE_bool("check", True, "compare outputs with the references at the largest shapes")
flags.DEFINE_integer("T", 5, "verify tokens (gamma + 1)")
flags.DEFINE_integer("inner", 16, "kernel calls per timed jit call")
flags.DEFINE_integer("repeats", 10, "timed calls (median)")
flags.DEFINE_integer("warmup", 2, "untimed calls after compilation")
flags.DEFINE_bool("ragged", True, "add a ragged-lengths variant at the largest context and batch")
flags.DEFINE_bool("smoke", False, "tiny shapes, reference impl (CPU test)")
flags.DEFINE_float("time_limit_s", 0.0, "seconds after which no measurement starts (0: none)")
flags.DEFINE_string("impl", "auto", "impl for our kernels")
flags.DEFINE_bool("sparse_sweep", False, "also time sparse_verify and sparse_verify_packed "
                  "at other tunings (`sparse_sweep`), at every budget they run at")
flags.DEFINE_list("srh_layouts", ["4q/4kv", "4q/2kv"], "kv-head layouts of the srh estimate's "
                  "4 query heads (`SRH_HEADS`)")
flags.DEFINE_bool("topk_sweep", False, "also time the Pallas top-k at other tunings (chunk "
                  "length, block, radix bits)")

MODELS = {  # name: (Hq, Hkv, D)
    "qwen2.5-7b": (28, 4, 128),
    "llama3-8b": (32, 8, 128),
    "qwen2.5-72b": (64, 8, 128),
    "tiny": (4, 2, 16),
}
L2_BYTES = 60 * 2**20  # H200's L2: calls cycle through 4x this of cache copies, so read HBM
N_LAYERS_7B = 28
SRH_HEADS = {  # kv-head layouts of the 4 SRH query heads (7B: G=7)
    "4q/4kv": lambda G: (0, G, 2 * G, 3 * G),
    "4q/2kv": lambda G: (0, 1, G, G + 1),
}
# --smoke: tiny shapes and few calls, on the reference kernels (CPU)
SMOKE = dict(models=["tiny"], contexts=["64"], batches=["2"], budgets=["8", "16"],
             srh_models=["tiny"], srh_budgets=["8"], inner=2, repeats=2, warmup=1, T=3)


def one_budget(budgets):
  """The budget run at the secondary shapes: 512 where listed, else the first."""
  return 512 if 512 in budgets else budgets[0]


def topk_sweep(S: int, K: int) -> list[dict]:
  """Tunings of the Pallas top-k beside its default: one program per row
  (chunk 0) or chunks of S / 16, S / 32 keys, blocks of 512 or 1024
  keys, passes of 2 or 4 radix bits; the default chunks with the
  candidates taken in groups of 0 (none), 2 or 8 segments; blocks of 4096
  or 8192 keys (a segment that fits is held whole) at 4 or 8 warps."""
  chunks = [0] + [c for c in (S // 16, S // 32) if c >= 4 * K]
  return ([dict(chunk=c, block=blk, radix_bits=bits)
           for c in chunks for blk in (512, 1024) for bits in (2, 4)]
          + [dict(group=g) for g in (0, 2, 8)]
          + [dict(group=g, block=512, radix_bits=4) for g in (0, 4)]
          # blocks that hold a whole chunk, group or candidate list
          + [dict(block=blk, num_warps=w) for blk in (4096, 8192) for w in (4, 8)]
          + [dict(block=8192, num_warps=8, radix_bits=b) for b in (3, 4)]
          + [dict(chunk=2048, block=8192, num_warps=8, group=g) for g in (0, 4)])


def sparse_sweep(kernel: str) -> list[dict]:
  """Tunings of the sparse kernels beside their defaults: 2 to 8 programs
  per (sequence, KV head), index blocks of 32 or 64 rows, 4 or 8 warps
  (`kernel` "sparse": sparse_verify's block_k; "packed": block_w)."""
  block = "block_k" if kernel == "sparse" else "block_w"
  return [{"splits": p, block: bk, "num_warps": w}
          for p in (2, 4, 6, 8) for bk in (32, 64) for w in (4, 8)]


def tuned_name(kernel: str, tuning: dict) -> str:
  """A record's kernel name with its tuning: `kernel:key=value...`
  (`prefetch=False` as `:no_prefetch`)."""
  return kernel + "".join(":no_prefetch" if (k, v) == ("prefetch", False) else f":{k}={v}"
                          for k, v in tuning.items())


def rel_err(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if not np.isfinite(out).all():
    return float("inf")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class Bench:
  """Measures kernels and collects their records (the JSON is rewritten after each)."""

  def __init__(self):
    self.records, self.errors = [], []
    self.pending = []  # (record, jitted fn, argsets) waiting for device timing
    self.decode_ms = {}  # (model, batch, context, ragged): the baseline's ms
    self.copy_bw = None
    self.t0 = time.perf_counter()
    self.dtype = jnp.float32 if FLAGS.smoke else jnp.bfloat16
    self.itemsize = jnp.dtype(self.dtype).itemsize
    self.device = getattr(jax.devices()[0], "device_kind", str(jax.devices()[0]))
    self.platform = jax.default_backend()

  def out_of_time(self):
    return FLAGS.time_limit_s and time.perf_counter() - self.t0 > FLAGS.time_limit_s

  def guard(self, what, fn):
    """fn() unless out of time; a failure is logged and the run goes on (None)."""
    if self.out_of_time():
      return None
    try:
      return fn()
    except Exception as e:
      msg = f"{what}: {type(e).__name__}: {str(e)[:300]}"
      print("  ERROR", msg, flush=True)
      traceback.print_exc(limit=3)
      self.errors.append(msg)
      return None

  def time_calls(self, fn, argsets, rec, state=None):
    """Times one jit holding a call of fn per argset (other queries, indices and
    cache copies: nothing cached or CSE'd): the median wall time over `repeats`
    per call goes into `rec`, which waits in `pending` for its device time.
    With `state` (the caches of a kernel that writes rows in place), every
    call is `fn(*argset, *state) -> (out, *state)`, the state threaded from
    call to call and donated to the jit, so no cache is copied.
    Returns the first call's output."""
    if state is None:
      f = jax.jit(lambda sets: [fn(*a) for a in sets])
      run = lambda: f(argsets)
    else:
      def calls(state, sets):
        outs = []
        for a in sets:
          out, *state = fn(*a, *state)
          outs.append(out)
        return tuple(state), outs
      f = jax.jit(calls, donate_argnums=0)
      box = [tuple(state)]

      def run():
        box[0], outs = f(box[0], argsets)
        return outs
    out = jax.block_until_ready(run())
    seconds, _ = median_seconds(run, FLAGS.warmup, FLAGS.repeats)
    rec["wall_ms"] = rec["ms"] = seconds / len(argsets) * 1e3
    self.pending.append((rec, run, len(argsets)))
    return out[0]

  def flush(self):
    """Runs the pending jits once more under the profiler (one trace): `gpu_ms`
    is the union of the GPU kernel intervals per call (XLA fusions included),
    `gpu_span_ms` first kernel start to last end; then adds the records."""
    items, self.pending = self.pending, []
    times = [(None, None)] * len(items)
    if items and self.platform == "gpu":
      with DeviceTimer() as timer:
        for _, run, _ in items:
          with timer.window("item"):
            jax.block_until_ready(run())
      times = timer.times("item", [n for _, _, n in items])
    for (rec, _, _), (busy, span) in zip(items, times):
      rec["gpu_ms"], rec["gpu_span_ms"] = busy, span
      rec["ms"] = busy or rec["ms"]
      self.add(rec)

  def add(self, rec):
    """Completes a record (bandwidth, speedup vs the baseline) and saves."""
    ms = rec["ms"]
    if rec["kernel"] == "copy":  # every bw_share is a share of this
      self.copy_bw = rec["bytes"] / (ms * 1e-3) / 1e12
    rec.update(T=FLAGS.T, device=self.device, platform=self.platform,
               jax_version=jax.__version__, copy_bw_tbs=self.copy_bw,
               dtype=str(jnp.dtype(self.dtype)), bw_tbs=rec["bytes"] / (ms * 1e-3) / 1e12)
    rec["bw_share"] = rec["bw_tbs"] / self.copy_bw if self.copy_bw else None
    key = (rec["model"], rec["batch"], rec["context"], rec["ragged"])
    if rec["kernel"] == "decode_attention":
      self.decode_ms[key] = ms
    base = self.decode_ms.get(key)
    rec["speedup_vs_decode_attention"] = base / ms if base else None
    if rec["kernel"].startswith("srh_scores+") and base:
      rec["ratio_vs_28x_decode"] = ms / (N_LAYERS_7B * base)
    self.records.append(rec)
    write_json(os.path.join(FLAGS.out_dir, FLAGS.json_name), self.records)
    print(" ", format_row(rec), flush=True)

  def measure_copy(self):
    """The copy bandwidth: a jnp copy of 2 GiB of bf16, read + written."""
    n = (2**22 if FLAGS.smoke else 2**30) // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32).astype(jnp.bfloat16)
    rec = dict(kernel="copy", model=None, batch=None, context=None, ragged=False,
               budget=None, bytes=2 * x.nbytes)
    self.time_calls(jnp.copy, [(x,)] * 2, rec)
    self.flush()

  def make_shape(self, model, B, ctx, ragged=False, seed=0):
    """Random cache copies, queries and lengths of one layer shape."""
    Hq, Hkv, D = MODELS[model]
    S = ctx + (8 if FLAGS.smoke else 2048)  # cache capacity: room past the context
    cache_bytes = 2 * B * Hkv * S * D * self.itemsize
    n_copies = int(min(FLAGS.inner, max(1, math.ceil(4 * L2_BYTES / cache_bytes))))
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * n_copies + FLAGS.inner)
    caches = [(jax.random.normal(keys[2 * c], (B, Hkv, S, D), self.dtype),
               jax.random.normal(keys[2 * c + 1], (B, Hkv, S, D), self.dtype))
              for c in range(n_copies)]
    qs = [jax.random.normal(k, (B, FLAGS.T, Hq, D), self.dtype) for k in keys[2 * n_copies:]]
    lengths = np.full((B,), ctx, np.int32)
    if ragged:
      lengths = np.random.default_rng(seed).integers(ctx // 8, ctx + 1, size=B).astype(np.int32)
    return dict(model=model, B=B, ctx=ctx, S=S, Hq=Hq, Hkv=Hkv, D=D, T=FLAGS.T, ragged=ragged,
                caches=caches, qs=qs, lengths_np=lengths, lengths=jnp.asarray(lengths),
                live_rows=np.minimum(lengths + FLAGS.T, S))  # per sequence, with the block

  def argsets(self, sh, extra=None):
    """(q, k, v, lengths[, extra]) per call, cycling over the cache copies."""
    sets = []
    for i in range(FLAGS.inner):
      k, v = sh["caches"][i % len(sh["caches"])]
      sets.append((sh["qs"][i], k, v, sh["lengths"]) + (() if extra is None else (extra[i],)))
    return sets

  def floor_bytes(self, sh, kv_rows):
    """HBM bytes of `kv_rows` K and V rows read, q read and out written."""
    return int((2 * kv_rows * sh["Hkv"] + 2 * sh["B"] * sh["T"] * sh["Hq"])
               * sh["D"] * self.itemsize)

  def record(self, sh, kernel, floor_bytes, budget=None, **extra):
    return dict(kernel=kernel, model=sh["model"], batch=sh["B"], context=sh["ctx"],
                ragged=sh["ragged"], Hq=sh["Hq"], Hkv=sh["Hkv"], D=sh["D"], budget=budget,
                bytes=floor_bytes, **extra)

  def run_full_cache(self, sh, kernel, fn, check=False):
    """decode_attention or xla_reference: attention over the whole live cache."""
    rec = self.record(sh, kernel, self.floor_bytes(sh, sh["live_rows"].sum()))
    sets = self.argsets(sh)
    out = self.time_calls(fn, sets, rec)
    if check:
      rec["rel_err_vs_reference"] = rel_err(out, jax.jit(decode_attention_reference)(*sets[0]))

  def sparse_indices(self, sh, K):
    """int32[inner, B, K]: K random distinct live positions per sequence and
    call, sorted, -1 padding past the context."""
    rng = np.random.default_rng(K)
    idx = np.full((FLAGS.inner, sh["B"], K), -1, np.int32)
    for i in range(FLAGS.inner):
      for b, L in enumerate(sh["lengths_np"]):
        idx[i, b, :min(K, L)] = np.sort(rng.choice(L, size=min(K, L), replace=False))
    return idx

  def run_sparse(self, sh, K, check=False):
    """sparse_verify over K random distinct live positions per sequence."""
    idx = self.sparse_indices(sh, K)
    # K/V rows read: the valid indices and the T block rows of each sequence
    rows = (idx[0] >= 0).sum() + sh["B"] * sh["T"]
    by = self.floor_bytes(sh, rows) + sh["B"] * K * 4
    rec = self.record(sh, "sparse_verify", by, budget=K)
    sets = self.argsets(sh, [jnp.asarray(i) for i in idx])
    out = self.time_calls(functools.partial(sparse_verify, impl=FLAGS.impl), sets, rec)
    if check:
      rec["rel_err_vs_reference"] = rel_err(out, jax.jit(sparse_verify_reference)(*sets[0]))
    for tuning in sparse_sweep("sparse") if FLAGS.sparse_sweep else []:
      name = tuned_name("sparse_verify", tuning)
      rec = self.record(sh, name, by, budget=K)
      self.guard(name, lambda: self.time_calls(
          functools.partial(sparse_verify, impl=FLAGS.impl, **tuning), sets, rec))

  def run_packed(self, sh, K):
    """A verify layer's attention from its packed q/k/v projection
    (sparse_verify_packed: RoPE, both cache-row writes and sparse_verify in
    one kernel), with and without the next index block's loads issued
    ahead; the caches threaded through the calls (written in place)."""
    B, T, Hq, Hkv, D = sh["B"], sh["T"], sh["Hq"], sh["Hkv"], sh["D"]
    G = Hq // Hkv
    idx = self.sparse_indices(sh, K)
    keys = jax.random.split(jax.random.PRNGKey(K + 1), FLAGS.inner)
    pos = sh["lengths"][:, None] + jnp.arange(T)[None]
    ang = pos[..., None].astype(jnp.float32) * 1e-3 * (1 + jnp.arange(D // 2))
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    sets = [(jax.random.normal(k, (B, T, Hkv, G + 2, D), self.dtype), sh["lengths"],
             jnp.asarray(i), cos, sin) for k, i in zip(keys, idx)]
    rows = (idx[0] >= 0).sum()
    # K and V rows read, the block's rows written, qkv and indices read, out written
    by = (self.floor_bytes(sh, rows) + 2 * B * T * Hkv * D * self.itemsize
          + B * T * Hkv * (G + 2) * D * self.itemsize + B * K * 4)

    def packed(qkv, lengths, indices, cos, sin, k_cache, v_cache, **tuning):
      return sparse_verify_packed(qkv, k_cache, v_cache, lengths, indices, cos, sin,
                                  impl=FLAGS.impl, **tuning)
    tunings = [{}, dict(prefetch=False)] + (sparse_sweep("packed") if FLAGS.sparse_sweep else [])
    for tuning in tunings:
      name = tuned_name("sparse_verify_packed", tuning)
      fn = functools.partial(packed, **tuning)
      k, v = sh["caches"][0]
      self.guard(name, lambda: self.time_calls(
          fn, sets, self.record(sh, name, by, budget=K), state=(k + 0, v + 0)))

  def run_srh(self, sh, layout, budgets):
    """srh_scores of the 4 SRH query heads, top-k of random scores, and both."""
    B, T, D, S, G = sh["B"], sh["T"], sh["D"], sh["S"], sh["Hq"] // sh["Hkv"]
    heads = list(SRH_HEADS[layout](G))
    kv_head = tuple(h // G for h in heads)
    qsets = [(q[:, :, heads], k, lengths) for q, k, _, lengths in self.argsets(sh)]
    scores_fn = functools.partial(srh_scores, kv_head=kv_head, impl=FLAGS.impl)
    by = srh_scores_bytes(B, int(sh["live_rows"].max()), D, kv_head, T, self.itemsize)
    srh = dict(srh_layout=layout, note=f"{len(kv_head)} SRH query heads on "
               f"{len(set(kv_head))} KV heads {kv_head}")
    rec = self.record(sh, "srh_scores", by["keys"] + by["scores"], **srh)
    self.time_calls(scores_fn, qsets, rec)
    scores = [(jax.random.uniform(jax.random.PRNGKey(i), (B, S)),) for i in range(FLAGS.inner)]
    for K in budgets:
      selects = []
      for method, name in (("lax", "topk"), ("two_stage", "topk_two_stage")):
        if method == "two_stage" and S <= max(4 * K, 2048):
          continue  # rows too short for a first stage to pay
        selects.append((name, functools.partial(select_topk, k=K, method=method)))
      # the exact Pallas top-k the tiered selection runs on GPU (its set,
      # in index order), at its default tuning and, with --topk_sweep, others
      for tuning in [{}] + (topk_sweep(S, K) if FLAGS.topk_sweep else []):
        name = tuned_name("topk_kernel", tuning)
        selects.append((name, functools.partial(topk, k=K, impl=FLAGS.impl, **tuning)))
      for name, select in selects:
        self.time_calls(select, scores, self.record(sh, name, B * S * 4, budget=K))
        if ":" in name:
          continue  # the sweep times the top-k alone
        rec = self.record(sh, f"srh_scores+{name}", by["keys"] + by["scores"], budget=K, **srh)
        self.time_calls(lambda q, k, L, select=select: select(scores_fn(q, k, L)), qsets, rec)

  def run_grid(self):
    """Every model at the largest context x batch first (all kernels), then
    its ragged variant, then the other shapes (secondary kernels only)."""
    ctxs = [int(c) for c in FLAGS.contexts]
    batches = [int(b) for b in FLAGS.batches]
    top = (max(ctxs), max(batches))
    pairs = sorted(((c, b) for c in ctxs for b in batches), key=lambda p: -p[0] * p[1])
    jobs = [(m, *top, False) for m in FLAGS.models]
    if FLAGS.ragged and not FLAGS.smoke:
      jobs += [(m, *top, True) for m in FLAGS.models]
    jobs += [(m, c, b, False) for m in FLAGS.models for (c, b) in pairs if (c, b) != top]
    for model, ctx, B, ragged in jobs:
      if self.out_of_time():
        print("time limit reached: stopping", flush=True)
        break
      print(f"== {model} B={B} ctx={ctx} ragged={ragged}", flush=True)
      self.run_shape(model, ctx, B, ragged, primary=(ctx, B) == top)
      self.flush()  # also past the time limit: what was measured is kept

  def run_shape(self, model, ctx, B, ragged, primary):
    """The kernels of one shape (its caches are freed on return)."""
    sh = self.guard("alloc", lambda: self.make_shape(model, B, ctx, ragged))
    if sh is None:  # e.g. out of memory: the next shape may fit
      return
    kernels = [k for k in FLAGS.kernels
               if (primary and not ragged) or k in FLAGS.secondary_kernels]
    check = FLAGS.check and primary
    if "decode" in kernels:
      decode = functools.partial(decode_attention, impl=FLAGS.impl)
      self.guard("decode", lambda: self.run_full_cache(sh, "decode_attention", decode, check))
    if "sparse" in kernels:
      budgets = [int(k) for k in FLAGS.budgets]
      every = f"{ctx}:{B}" in FLAGS.budget_shapes if FLAGS.budget_shapes else primary
      for K in budgets if every and not ragged else [one_budget(budgets)]:
        self.guard(f"sparse K={K}", lambda: self.run_sparse(
            sh, K, check=check and K == one_budget(budgets)))
    if "packed" in kernels and not ragged:
      self.run_packed(sh, one_budget([int(k) for k in FLAGS.budgets]))
    if "xla" in kernels:
      self.guard("xla", lambda: self.run_full_cache(sh, "xla_reference",
                                                    decode_attention_reference))
    if "srh" in kernels and model in FLAGS.srh_models:
      budgets = [int(k) for k in FLAGS.srh_budgets]
      budgets = budgets if primary else [one_budget(budgets)]
      for layout in ["4q/2kv"] if FLAGS.smoke else FLAGS.srh_layouts:
        self.guard(f"srh {layout}", lambda: self.run_srh(sh, layout, budgets))


TABLE_HEADER = (f"{'kernel':<34}{'model':<13}{'B':>4}{'ctx':>7}{'K':>6}{'rag':>4}"
                f"{'ms':>10}{'wall_ms':>9}{'bw%':>6}{'x dec':>8}")


def format_row(r):
  """One row of the table under TABLE_HEADER."""
  bw, speedup = r["bw_share"] or 0, r["speedup_vs_decode_attention"] or 0
  row = (f"{r['kernel']:<34}{str(r['model']):<13}{str(r['batch']):>4}{str(r['context']):>7}"
         f"{str(r['budget'] or '-'):>6}{'y' if r['ragged'] else '':>4}"
         f"{r['ms']:>10.4f}{r['wall_ms']:>9.4f}{100 * bw:>6.1f}{speedup:>8.2f}")
  if "srh_layout" in r:
    row += f" [{r['srh_layout']}]"
  if "ratio_vs_28x_decode" in r:
    row += f" {100 * r['ratio_vs_28x_decode']:.2f}% of 28x decode"
  if "rel_err_vs_reference" in r:
    row += f" err={r['rel_err_vs_reference']:.1e}"
  return row


def plot(records, path):
  """(a) bandwidth share of the full-cache kernels vs context at the largest
  batch; (b) sparse_verify's speedup vs budget at the largest shape."""
  recs = [r for r in records if r["kernel"] != "copy" and not r["ragged"]]
  if not recs:
    return
  models = list(dict.fromkeys(r["model"] for r in recs))
  bmax = max(r["batch"] for r in recs)
  cmax = max(r["context"] for r in recs)
  fig, (ax_a, ax_b) = pyplot().subplots(1, 2, figsize=(12, 4.6))
  for kernel, style in (("decode_attention", "o-"), ("xla_reference", "s:")):
    for i, m in enumerate(models):
      pts = sorted((r["context"], r["bw_share"]) for r in recs if r["kernel"] == kernel
                   and r["model"] == m and r["batch"] == bmax and r["bw_share"])
      if pts:
        ax_a.plot(*zip(*pts), style, color=f"C{i}", label=f"{kernel} {m}")
  ax_a.axhline(0.85, color="gray", lw=0.8, label="85% (design bar of a fair baseline)")
  ax_a.set(ylim=(0, None), xlabel="context (tokens)", ylabel="share of the copy bandwidth",
           title=f"(a) full-cache verify attention, B={bmax}")
  for i, m in enumerate(models):
    pts = sorted((r["budget"], r["speedup_vs_decode_attention"]) for r in recs
                 if r["kernel"] == "sparse_verify" and r["model"] == m and r["batch"] == bmax
                 and r["context"] == cmax and r["speedup_vs_decode_attention"])
    if pts:
      ax_b.plot(*zip(*pts), "o-", color=f"C{i}", label=m)
  ax_b.axhline(40, color="gray", lw=0.8, label="40x (target at K=512)")
  ax_b.set(ylim=(0, None), xlabel="budget K (cache rows gathered)",
           ylabel="speedup vs decode_attention (ms ratio)",
           title=f"(b) sparse_verify, B={bmax}, ctx={cmax}")
  for ax in (ax_a, ax_b):  # contexts and budgets are powers of 2
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")
    ax.minorticks_off()
    ax.legend(fontsize=7)
  save_figure(fig, path)


def main(argv):
  del argv
  compile_cache_from_flag()
  if FLAGS.smoke:
    for name, value in SMOKE.items():
      setattr(FLAGS, name, value)
  unknown = sorted(set(FLAGS.srh_layouts) - set(SRH_HEADS))
  if unknown:
    raise app.UsageError(f"--srh_layouts: unknown {unknown}; known: {sorted(SRH_HEADS)}")
  bench = Bench()
  print(f"device {bench.device}  jax {jax.__version__}", flush=True)
  bench.measure_copy()
  print(f"copy bandwidth {bench.copy_bw:.3f} TB/s", flush=True)
  bench.run_grid()
  print(f"\ncopy bandwidth {bench.copy_bw:.3f} TB/s ({bench.device}, jax {jax.__version__})")
  print(TABLE_HEADER)
  for r in bench.records:
    if r["kernel"] != "copy":
      print(format_row(r))
  json_path = os.path.join(FLAGS.out_dir, FLAGS.json_name)
  plot(bench.records, os.path.splitext(json_path)[0] + ".png")
  if bench.errors:
    print(f"\n{len(bench.errors)} errors:")
    for e in bench.errors:
      print(" ", e)


if __name__ == "__main__":
  app.run(main)
