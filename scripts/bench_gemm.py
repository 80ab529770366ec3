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
time. Writes gemm.json (records) and gemm.png. `--impls=stream` also times
the Mosaic GPU kernel of `kernels.stream_matmul` (Hopper) at each
`--stream_tilings`, the gate/up projection with its SwiGLU epilogue, beside
XLA's gate/up GEMM followed by silu(gate) * up (`epilogue` "swiglu").

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
from kernels.stream_matmul.ops import stream_matmul
from scripts.benchmarking import (DeviceTimer, benchmark_pairs, compile_cache_from_flag,
                                  partial_products, pyplot, save_figure, write_json)

flags.DEFINE_string("out_dir", "results/h200", "where gemm.json and gemm.png go")
flags.DEFINE_list("models", ["qwen7b"], "benchmark pairs (configs.shapes.PAIRS)")
flags.DEFINE_list("rows", ["8", "16", "40", "80"], "activation rows (batch x tokens)")
flags.DEFINE_integer("ways", 1, "tensor-parallel ways: time one device's shard")
flags.DEFINE_list("parts", ["1"], "each projection also as this many f32 partial products over "
                  "slices of K (`partial_products`: a consumer would sum them); 1: the plain "
                  "product")
flags.DEFINE_list("impls", ["xla"], "xla: jnp.dot (XLA's GEMMs); stream: the Mosaic GPU "
                  "kernel of kernels.stream_matmul (Hopper), once per --stream_tilings")
flags.DEFINE_list("stream_tilings", ["64:64:4"], "tile_n:tile_k:stages[:splits] of the stream "
                  "kernel; a tiling the shape does not divide, or whose shared memory does not "
                  "fit, is recorded as an error")
flags.DEFINE_integer("flush_mb", 256, "weight bytes per timed jit (> L2: no cache reuse)")
flags.DEFINE_integer("repeats", 5, "timed calls per measurement (median)")
flags.DEFINE_string("xla_flags", "", "appended to XLA_FLAGS before jax starts")
flags.DEFINE_bool("smoke", False, "tiny shapes (CPU)")
FLAGS = flags.FLAGS


def plain_dot(x, w):
  """The f32 product cast to bf16 (an f32 GEMM result and a separate
  convert), beside `Linear`'s bias-free projections, which ask the GEMM for
  bf16 directly (dustin_jax/models/decoder.py)."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def swiglu_xla(x, w, block: int):
  """XLA's gate/up GEMM and silu(gate) * up over w's blocks of `block` gate
  then `block` up columns (the stream kernel's layout)."""
  y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
  y = y.reshape(x.shape[0], -1, 2, block)
  return (jax.nn.silu(y[:, :, 0]) * y[:, :, 1]).reshape(x.shape[0], -1)


def stream_variants(proj: str) -> list[dict]:
  """The stream kernel's variants of one projection: gate/up with the
  SwiGLU epilogue, the others as plain products or f32 partials."""
  out = []
  for tiling in FLAGS.stream_tilings:
    tile_n, tile_k, stages, *splits = (int(v) for v in tiling.split(":"))
    out.append(dict(tiling=tiling, tile_n=tile_n, tile_k=tile_k, stages=stages,
                    splits=splits[0] if splits else 1, swiglu=proj == "gate_up"))
  return out


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
  unknown = sorted(set(FLAGS.impls) - {"xla", "stream"})
  if unknown:
    raise app.UsageError(f"--impls: unknown {unknown} (xla, stream)")
  append_xla_flags(FLAGS.xla_flags)
  if "stream" in FLAGS.impls and jax.default_backend() != "gpu":
    raise app.UsageError("--impls=stream times the Mosaic GPU kernel: it needs a Hopper GPU")
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
          variants = [dict(impl="xla", parts=p) for p in (int(p) for p in FLAGS.parts)
                      if k % p == 0]
          if "stream" in FLAGS.impls:
            if proj == "gate_up":  # the same product and epilogue, by XLA
              variants += [dict(impl="xla", parts=1, epilogue="swiglu", block=v["tile_n"])
                           for v in stream_variants(proj)[:1]]
            variants += [dict(impl="stream", **v) for v in stream_variants(proj)]
          for v in variants:
            if v["impl"] == "stream":
              tune = {t: v[t] for t in ("swiglu", "splits", "tile_n", "tile_k", "stages")}
              fn = lambda xs, ws, tune=tune: [stream_matmul(x, w, impl="gpu", **tune)
                                              for x, w in zip(xs, ws)]
            elif v.get("epilogue"):
              fn = lambda xs, ws, b=v["block"]: [swiglu_xla(x, w, b) for x, w in zip(xs, ws)]
            elif v["parts"] == 1:
              fn = lambda xs, ws: [plain_dot(x, w) for x, w in zip(xs, ws)]
            else:
              fn = lambda xs, ws, parts=v["parts"]: [partial_products(x, w, parts)
                                                     for x, w in zip(xs, ws)]
            rec = dict(meta, kernel="gemm", model=name, role=role, proj=proj, k=k, n=n_out,
                       rows=rows, weight_bytes=wbytes, copies=copies, **v)
            rec.setdefault("parts", v.get("splits", 1))
            try:
              dev_ms, wall_ms = timed(fn, (xs, ws))
            except Exception as e:  # a tiling the kernel refuses: recorded, not fatal
              if v["impl"] != "stream":
                raise
              records.append(dict(rec, error=str(e)[:500]))
              print(f"{proj} rows={rows} stream {v['tiling']}: {str(e)[:300]}", flush=True)
              continue
            us = 1e3 * (dev_ms or wall_ms) / copies
            rec.update(us=us, kernels_per_product=launches_per_call(fn, (xs, ws)) / copies,
                       gpu=dev_ms is not None, tbs=wbytes / (us * 1e-6) / 1e12)
            rec["bw_frac"] = rec["tbs"] / copy_tbs
            records.append(rec)
            label = v.get("tiling") or f"parts={v['parts']}" + (
                f" {v['epilogue']}" if v.get("epilogue") else "")
            print(f"{name} {role:6s} {proj:8s} K={k:6d} N={n_out:6d} rows={rows:3d} "
                  f"{v['impl']:6s} {label:14s} {us:8.2f} us  {rec['bw_frac']:6.0%} of copy BW  "
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
  gemms = [r for r in records if r["kernel"] == "gemm" and r["impl"] == "xla"
           and r["parts"] == 1 and not r.get("epilogue")]
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
