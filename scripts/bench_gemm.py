r"""How close the decoder's projections come to the bandwidth at decode rows.

A decode or verify forward multiplies a few activation rows (batch x tokens:
16 for a draft pass at batch 16, 80 for the verify of gamma 4) by every
weight matrix once, so each projection is memory-bound: its floor is its
weight bytes at the copy bandwidth. The e2e profile of the 7B + 0.5B step
(results/h200/README.md) puts the draft's projections at 15-50% of that and
the verify's merged q/k/v at ~35%; this measures them one by one.

Times, in one process: each projection of a benchmark pair
(`configs.shapes.PAIRS`; `--ways` > 1: one tensor-parallel shard) at each row
count, as one product (`plain_dot`: bf16 in, f32 accumulation, cast to bf16;
the bias and activation epilogues XLA fuses in the model are left out),
against a jnp copy's bandwidth measured in the same run. Each timed jit holds enough distinct
weight copies to overflow the L2 cache, as a model's layers do. GPU time
from the profiler trace (`scripts.benchmarking.DeviceTimer`), else wall
time. The timed jit's products are independent, whereas each of a
forward's waits for the one before it: by default (`--xla_flags`) the CUDA
graph is recorded serialized, so each product runs alone, as in a forward,
not overlapped with its neighbours. Writes gemm.json (records) and gemm.png.

  python -m scripts.bench_gemm --out_dir=results/h200
  python -m scripts.bench_gemm --smoke --out_dir=/tmp/g   # CPU, tiny shapes
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from dustin_jax.config import ModelConfig, append_xla_flags
from scripts.benchmarking import (DeviceTimer, benchmark_pairs, compile_cache_from_flag,
                                  partial_products, pyplot, save_figure, write_json)

flags.DEFINE_string("out_dir", "results/h200", "where gemm.json and gemm.png go")
flags.DEFINE_list("models", ["qwen7b"], "benchmark pairs (configs.shapes.PAIRS)")
flags.DEFINE_list("rows", ["8", "16", "40", "80"], "activation rows (batch x tokens)")
flags.DEFINE_integer("ways", 1, "tensor-parallel ways: time one device's shard")
flags.DEFINE_list("parts", ["1"], "each projection also as this many f32 partial products over "
                  "slices of K (`partial_products`: a consumer would sum them); 1: the plain "
                  "product")
flags.DEFINE_integer("flush_mb", 256, "weight bytes per timed jit (> L2: no cache reuse)")
flags.DEFINE_integer("repeats", 5, "timed calls per measurement (median)")
flags.DEFINE_string("xla_flags", "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE",
                    "appended to XLA_FLAGS before jax starts")
flags.DEFINE_bool("smoke", False, "tiny shapes (CPU)")
FLAGS = flags.FLAGS


def plain_dot(x, w):
  """The f32 product cast to bf16 (an f32 GEMM result and a separate
  convert), beside `Linear`'s bias-free projections, which ask the GEMM for
  bf16 directly (dustin_jax/models/decoder.py)."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def launches_per_call(fn, args) -> int:
  """Kernels one call of jitted `fn` launches: the fusions, custom calls and
  sorts at the top of its compiled module (bitcasts and tuples launch
  nothing)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  return len(re.findall(r"= \S+ (?:fusion|custom-call|sort|copy|reduce|transpose)\(", entry))


def projections(cfg, ways: int) -> dict[str, tuple[int, int]]:
  """(K, N) of each projection of one layer (+ the LM head) on one device of
  a `ways`-way tensor-parallel split: column-parallel q/k/v, gate/up and LM
  head split N, row-parallel o and down split K. q/k/v and gate/up appear
  merged, as XLA runs them (one GEMM over the shared input)."""
  d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  return {"qkv": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd // ways),
          "o": (cfg.num_heads * hd // ways, d),
          "gate_up": (d, 2 * f // ways),
          "down": (f // ways, d),
          "lm_head": (d, cfg.vocab_size // ways)}


def main(argv):
  del argv
  append_xla_flags(FLAGS.xla_flags)
  compile_cache_from_flag()
  out_json = os.path.join(FLAGS.out_dir, "gemm.json")
  dtype = jnp.bfloat16
  device = jax.devices()[0].device_kind
  meta = dict(device=device, jax_version=jax.__version__, ways=FLAGS.ways,
              xla_flags=os.environ.get("XLA_FLAGS", ""))
  flush = (FLAGS.flush_mb if not FLAGS.smoke else 4) * 2**20

  def timed(fn, args):
    """(device ms or None, wall ms) of one call of jitted `fn(*args)`."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    walls = []
    with DeviceTimer() as t:
      for _ in range(FLAGS.repeats):
        with t.window("call"):
          t0 = time.perf_counter()
          jax.block_until_ready(f(*args))
          walls.append(1e3 * (time.perf_counter() - t0))
    dev = t.ms("call")
    return (statistics.median(dev) if dev else None), statistics.median(walls)

  n = flush // 2
  src = jnp.ones((n,), dtype)
  dev_ms, wall_ms = timed(jnp.copy, (src,))
  copy_tbs = 2 * src.nbytes / ((dev_ms or wall_ms) * 1e-3) / 1e12
  del src
  records = [dict(meta, kernel="copy", bytes=2 * n * 2, ms=dev_ms or wall_ms, tbs=copy_tbs)]
  print(f"copy bandwidth {copy_tbs:.2f} TB/s on {device}", flush=True)

  pairs = benchmark_pairs(FLAGS.smoke)
  key = jax.random.key(0)
  for name in FLAGS.models if not FLAGS.smoke else ["tiny"]:
    for role, hf in zip(("target", "draft"), pairs[name]):
      cfg = ModelConfig.from_hf(dict(hf), dtype="bfloat16")
      ways = FLAGS.ways if role == "target" else 1  # the draft runs whole
      for proj, (k, n_out) in projections(cfg, ways).items():
        wbytes = k * n_out * 2
        copies = max(2, min(64, math.ceil(flush / wbytes)))
        key, kw, kx = jax.random.split(key, 3)
        ws = [jax.random.normal(kk, (k, n_out), dtype) * 0.02 for kk in jax.random.split(kw, copies)]
        for rows in (int(r) for r in FLAGS.rows):
          xs = [jax.random.normal(kk, (rows, k), dtype) for kk in jax.random.split(kx, copies)]
          for parts in (int(p) for p in FLAGS.parts):
            if k % parts:
              continue
            if parts == 1:
              fn = lambda xs, ws: [plain_dot(x, w) for x, w in zip(xs, ws)]
            else:
              fn = lambda xs, ws, parts=parts: [partial_products(x, w, parts)
                                                for x, w in zip(xs, ws)]
            dev_ms, wall_ms = timed(fn, (xs, ws))
            us = 1e3 * (dev_ms or wall_ms) / copies
            rec = dict(meta, kernel="gemm", model=name, role=role, proj=proj, k=k, n=n_out,
                       rows=rows, parts=parts, weight_bytes=wbytes, copies=copies, us=us,
                       kernels_per_product=launches_per_call(fn, (xs, ws)) / copies,
                       gpu=dev_ms is not None, tbs=wbytes / (us * 1e-6) / 1e12)
            rec["bw_frac"] = rec["tbs"] / copy_tbs
            records.append(rec)
            print(f"{name} {role:6s} {proj:8s} K={k:6d} N={n_out:6d} rows={rows:3d} "
                  f"parts={parts:2d} {us:8.2f} us  {rec['bw_frac']:6.0%} of copy BW  "
                  f"{rec['kernels_per_product']:.1f} kernels", flush=True)
          del xs
        del ws
  write_json(out_json, records)
  save_plot(records, out_json.replace(".json", ".png"))
  print(f"wrote {out_json}")


def save_plot(records, path):
  """Share of the copy bandwidth of XLA's GEMM (one product, not `--parts`
  partial products) per projection and row count; a row of panels per
  model, a column per role."""
  gemms = [r for r in records if r["kernel"] == "gemm" and r["parts"] == 1]
  models = sorted({r["model"] for r in gemms})
  roles = sorted({r["role"] for r in gemms}, reverse=True)  # target, draft
  if not models:
    return
  fig, axes = pyplot().subplots(len(models), len(roles), squeeze=False,
                                figsize=(6 * len(roles), 4 * len(models)))
  for ax, (model, role) in zip(axes.flat, [(m, r) for m in models for r in roles]):
    mine = [r for r in gemms if (r["model"], r["role"]) == (model, role)]
    projs = list(dict.fromkeys(r["proj"] for r in mine))
    rows = sorted({r["rows"] for r in mine})
    width = 0.8 / len(rows)
    for j, m in enumerate(rows):
      share = [next((r["bw_frac"] for r in mine if r["proj"] == p and r["rows"] == m), 0)
               for p in projs]
      ax.bar([i + j * width for i in range(len(projs))], share, width, label=f"{m} rows")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(projs))], projs)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel("share of the copy bandwidth")
    ax.set_title(f"{model} {role}")
    ax.legend(fontsize=7)
  save_figure(fig, path)


if __name__ == "__main__":
  app.run(main)
