r"""Prefill throughput: the layer-major prefill against its anchor.

  python -m scripts.bench_prefill --out=results/h200/prefill.json --pairs=qwen7b,llama3_8b \
      --contexts=8192,16384,32768 --batches=1,8,16
  python -m scripts.bench_prefill --real_pair --contexts=4096 --batches=8 \
      --out=results/cpu/prefill_real.json                          # CPU, the real pair

Per (pair, batch, context), in one process, random weights of the real
shapes (`configs.shapes.PAIRS`; `--num_layers` cuts both models for quick
runs) or, with `--real_pair`, the offline Qwen2.5-Coder 1.5B + 0.5B (f32):
  target_s, draft_s   `dustin_jax.models.prefill.prefill_cache` of `batch`
                      prompts into an empty cache of `context` rows, each model
                      compiled ahead (`compile_s`) and timed alone, wall clock
                      up to `block_until_ready`, median of `--repeats` calls
                      after `--warmup` untimed ones; prefill_s = their sum
  tokens_per_s        prompt tokens written per second of prefill_s
  anchor_s            what the hardware allows: ONE target layer's attention
                      (cuDNN flash attention on GPU, the blockwise reference
                      elsewhere) plus its GEMMs (q/k/v, o, gate/up, down; no
                      norms, rope or cache writes) over the whole batch, timed
                      alone in this process and multiplied by the layer count
Prompts: random tokens; every prompt body is `context` tokens (cache rows
filled exactly), or, with `--ragged`, between 7/8 of it and all of it.
A configuration whose estimated memory exceeds the device's is skipped with
a record saying so; an error is recorded and the run goes on. Writes the
records (JSON list) to `--out` and a plot beside it (.png).
"""

from __future__ import annotations

import json
import os
import time
import traceback

from absl import app
from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from dustin_jax import sharding, weights
from dustin_jax.assets import ensure_model
from dustin_jax.cache import KVCache
from dustin_jax.config import ModelConfig
from dustin_jax.decoding import Model
from dustin_jax.models import prefill as lm
from dustin_jax.profiling.runtime import REAL_DRAFT, REAL_TARGET
from kernels.common import resolve_impl
from kernels.prefill_attention.reference import prefill_attention_reference
from scripts.benchmarking import (benchmark_pairs, capacity_bytes, compile_cache_from_flag,
                                  median_seconds, pyplot, random_model, save_figure,
                                  write_json)

flags.DEFINE_string("out", "results/h200/prefill.json", "JSON records; the PNG goes beside it")
flags.DEFINE_list("pairs", ["qwen7b", "llama3_8b"], "benchmark pairs (configs.shapes.PAIRS)")
flags.DEFINE_list("contexts", ["8192", "16384", "32768"], "prompt tokens per sequence")
flags.DEFINE_list("batches", ["1", "8", "16"], "prompts per batch")
flags.DEFINE_integer("num_layers", 0, "keep only this many layers of both models (0: all)")
flags.DEFINE_string("dtype", "", "bfloat16 or float32 (default: bfloat16 on GPU/TPU, float32 "
                    "on CPU; the real pair is always float32)")
flags.DEFINE_string("impl", "auto", "prefill attention impl (auto, reference, gpu, tpu)")
flags.DEFINE_integer("token_block", 0, "tokens per tile of the per-token work (0: the default)")
flags.DEFINE_bool("real_pair", False, "the offline Qwen2.5-Coder 1.5B + 0.5B GGUF pair, f32")
flags.DEFINE_bool("ragged", False, "prompt bodies between 7/8 of the context and all of it")
flags.DEFINE_bool("anchor", True, "time the anchor (one target layer x layers)")
flags.DEFINE_integer("repeats", 1, "timed calls per measurement (median)")
flags.DEFINE_integer("warmup", -1, "untimed calls after compiling (-1: 1 on GPU/TPU, 0 on CPU, "
                     "where one call of the real pair takes minutes)")
flags.DEFINE_float("time_budget_s", 0, "stop starting new configurations after this long (0: none)")
flags.DEFINE_bool("smoke", False, "tiny random pair (configs.tiny), for the CPU schema test")
FLAGS = flags.FLAGS


def make_prompts(batch, context, vocab, seed, ragged):
  """`batch` random prompts of `context` + 1 tokens (bodies of `context`),
  or ragged bodies in [7/8 context, context]."""
  rng = np.random.default_rng(seed)
  lens = (rng.integers(context - context // 8, context + 1, size=batch) if ragged
          else np.full(batch, context))
  return [rng.integers(0, vocab, size=int(n) + 1).tolist() for n in lens]


def prefill_bytes(tcfg, dcfg, batch, context, token_block, impl) -> int:
  """Peak bytes of prefilling both models at `batch` x `context`
  (`sharding.memory_plan`: both models' weights and caches, the larger
  prefill's activations; the jnp attention's f32 copies where it runs)."""
  plan = sharding.memory_plan(tcfg, dcfg, batch=batch, max_len=context, data=1, model=1,
                              token_block=token_block,
                              f32_prefill_attention=resolve_impl(impl) == "reference")
  return plan.total


def time_new(model, prompts, max_len, impl, token_block, warmup, repeats):
  """(compile_s, run_s) of the layer-major prefill of `prompts`."""
  tok, n = lm.pack_prompts(prompts, max_len)
  tok, n = jnp.asarray(tok), jnp.asarray(n)
  fresh = lambda: KVCache.init(model.cfg, len(prompts), max_len)
  t0 = time.perf_counter()
  compiled = lm.prefill_cache.lower(model.graphdef, model.state, jax.eval_shape(fresh), tok, n,
                                    impl=impl, token_block=token_block).compile()
  compile_s = time.perf_counter() - t0
  run_s, _ = median_seconds(lambda: compiled(model.state, fresh(), tok, n), warmup, repeats)
  return compile_s, run_s


def anchor_layer_s(cfg, batch, s, token_block, dtype, warmup, repeats):
  """Seconds of one layer's attention + GEMMs over `batch` x `s` tokens (see
  the module doc): attention of the whole causal sequence, then the GEMMs
  in tiles of `token_block` rows (the MLP intermediate of every token at
  once would not fit)."""
  hq, hkv, hd, d, f = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                       cfg.intermediate_size)
  n = batch * s
  tb = max(1, min(token_block, n))
  while n % tb:  # whole tiles: the anchor times GEMMs, not remainders
    tb -= 1
  key = iter(jax.random.split(jax.random.key(0), 8))
  rnd = lambda *shape: (0.02 * jax.random.normal(next(key), shape, jnp.float32)).astype(dtype)
  x = rnd(n, d)
  q, k, v = rnd(batch, s, hq, hd), rnd(batch, s, hkv, hd), rnd(batch, s, hkv, hd)
  w = dict(qkv=rnd(d, (hq + 2 * hkv) * hd), o=rnd(hq * hd, d), gu=rnd(d, 2 * f), down=rnd(f, d))
  gpu_cudnn = jax.default_backend() == "gpu" and jnp.dtype(dtype) != jnp.float32

  def layer(x, q, k, v, w):
    if gpu_cudnn:
      attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
      attn = prefill_attention_reference(q, k, v, jnp.full((batch,), s, jnp.int32))
    a = attn.reshape(n, hq * hd)

    def tile(i, outs):
      qkv_all, y_all = outs
      xs = lax.dynamic_slice_in_dim(x, i * tb, tb)
      qkv = jnp.dot(xs, w["qkv"], preferred_element_type=dtype)
      o = jnp.dot(lax.dynamic_slice_in_dim(a, i * tb, tb), w["o"], preferred_element_type=dtype)
      g, u = jnp.split(jnp.dot(xs, w["gu"], preferred_element_type=dtype), 2, axis=-1)
      y = o + jnp.dot(jax.nn.silu(g) * u, w["down"], preferred_element_type=dtype)
      return (lax.dynamic_update_slice_in_dim(qkv_all, qkv, i * tb, 0),
              lax.dynamic_update_slice_in_dim(y_all, y, i * tb, 0))

    init = (jnp.zeros((n, (hq + 2 * hkv) * hd), dtype), jnp.zeros((n, d), dtype))
    return lax.fori_loop(0, n // tb, tile, init)

  compiled = jax.jit(layer).lower(x, q, k, v, w).compile()
  return median_seconds(lambda: compiled(x, q, k, v, w), max(1, warmup), repeats)[0]


def load_real_pair():
  """(target, draft) Models of the offline Qwen2.5-Coder 1.5B / 0.5B GGUF
  files, f32."""
  target, draft = (Model(*weights.load_gguf_checkpoint(str(ensure_model(name, progress=False))))
                   .with_folded_norms() for name in (REAL_TARGET, REAL_DRAFT))
  return target, draft, f"{REAL_TARGET}+{REAL_DRAFT.split('-')[-2]}"


def main(argv):
  del argv
  compile_cache_from_flag()
  t_start = time.perf_counter()
  platform = jax.default_backend()
  device = jax.devices()[0].device_kind
  warmup = FLAGS.warmup if FLAGS.warmup >= 0 else (0 if platform == "cpu" else 1)
  dtype = "float32" if FLAGS.real_pair else FLAGS.dtype or (
      "float32" if platform == "cpu" else "bfloat16")
  token_block = FLAGS.token_block or lm.DEFAULT_TOKEN_BLOCK
  cap = capacity_bytes()
  records = []
  save = lambda: write_json(FLAGS.out, records)
  if FLAGS.real_pair:
    target, draft, name = load_real_pair()
    runs = [(name, target, draft)]
  else:
    runs = []
    pairs = benchmark_pairs(FLAGS.smoke)
    for name in pairs if FLAGS.smoke else FLAGS.pairs:
      thf, dhf = pairs[name]
      layers = FLAGS.num_layers or None
      tcfg = ModelConfig.from_hf(dict(thf), dtype=dtype, num_layers=layers)
      dcfg = ModelConfig.from_hf(dict(dhf), dtype=dtype, num_layers=layers)
      runs.append((name, tcfg, dcfg))
  contexts = sorted(int(c) for c in FLAGS.contexts)
  batches = [int(b) for b in FLAGS.batches]
  for name, t, d in runs:
    if not FLAGS.real_pair:  # weights made per pair, dropped after it
      t, d = random_model(t, 0), random_model(d, 1)
    for batch in batches:
      for context in contexts:
        if FLAGS.time_budget_s and time.perf_counter() - t_start > FLAGS.time_budget_s:
          print("time budget reached; stopping", flush=True)
          save()
          return finish(records)
        rec = dict(model=name, target_layers=t.cfg.num_layers, draft_layers=d.cfg.num_layers,
                   batch=batch, context=context, impl=FLAGS.impl, token_block=token_block,
                   dtype=dtype, device=device, platform=platform, jax_version=jax.__version__,
                   warmup=warmup, repeats=FLAGS.repeats, ragged=FLAGS.ragged)
        need = prefill_bytes(t.cfg, d.cfg, batch, context, token_block, FLAGS.impl)
        if need > 0.9 * cap:
          rec.update(skipped="memory", need_gib=need / 2**30, capacity_gib=cap / 2**30)
          print(f"skip {name} B={batch} ctx={context}: ~{need / 2**30:.1f} GiB > "
                f"{0.9 * cap / 2**30:.1f} GiB", flush=True)
          records.append(rec)
          save()
          continue
        prompts = make_prompts(batch, context, min(t.cfg.vocab_size, d.cfg.vocab_size),
                               seed=batch * 7919 + context, ragged=FLAGS.ragged)
        tokens = sum(len(p) - 1 for p in prompts)
        rec["tokens"] = tokens
        rec["loadavg_start"] = os.getloadavg()[0]
        records.append(rec)  # saved after each measurement: a killed run keeps what it had
        try:
          for role, m in (("target", t), ("draft", d)):
            c_s, run_s = time_new(m, prompts, context, FLAGS.impl, token_block, warmup,
                                  FLAGS.repeats)
            rec[f"{role}_compile_s"], rec[f"{role}_s"] = c_s, run_s
            save()
            print(f"  {name} {role} B={batch} ctx={context}: {run_s:.3f} s "
                  f"(compile {c_s:.1f} s)", flush=True)
          rec["prefill_s"] = rec["target_s"] + rec["draft_s"]
          rec["tokens_per_s"] = tokens / rec["prefill_s"]
          if FLAGS.anchor:
            layer_s = anchor_layer_s(t.cfg, batch, context, token_block, t.cfg.dtype, warmup,
                                     FLAGS.repeats)
            rec.update(anchor_layer_s=layer_s, anchor_s=layer_s * t.cfg.num_layers,
                       anchor_tokens_per_s=tokens / (layer_s * t.cfg.num_layers),
                       target_vs_anchor=rec["target_s"] / (layer_s * t.cfg.num_layers))
        except Exception as e:  # noqa: BLE001 -- one failing configuration is a record
          rec["error"] = f"{type(e).__name__}: {e}"[:500]
          traceback.print_exc(limit=4)
        rec["loadavg_end"] = os.getloadavg()[0]
        print(json.dumps({k: rec.get(k) for k in (
            "model", "batch", "context", "prefill_s", "tokens_per_s", "anchor_s",
            "anchor_tokens_per_s", "error")}), flush=True)
        save()
  save()
  finish(records)


def finish(records):
  save_plot(records, os.path.splitext(FLAGS.out)[0] + ".png")
  print(f"wrote {FLAGS.out}")


def save_plot(records, path):
  """Tokens/s against context, one panel per pair: the layer-major prefill
  (solid, circles) and the anchor (dotted, triangles); colour: batch."""
  plt = pyplot()
  ok = [r for r in records if r.get("tokens_per_s")]
  models = sorted({r["model"] for r in ok}) or ["(no measurement)"]
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, m in zip(axes[0], models):
    rows = [r for r in ok if r["model"] == m]
    for i, b in enumerate(sorted({r["batch"] for r in rows})):
      pts = sorted((r["context"], r) for r in rows if r["batch"] == b)
      c = colors[i % len(colors)]
      for key, ls, mk, label in (("tokens_per_s", "-", "o", "layer-major"),
                                 ("anchor_tokens_per_s", ":", "^", "anchor (target only)")):
        xy = [(x, r[key]) for x, r in pts if r.get(key)]
        if xy:
          ax.plot(*zip(*xy), ls=ls, marker=mk, color=c, label=f"B={b} {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens per sequence")
    ax.set_ylabel("prefill tokens/s (target + draft; anchor: target)")
    dev = rows[0]["device"] if rows else ""
    ax.set_title(f"{m} on {dev}")
    ax.grid(True, which="both", lw=0.3)
    if rows:
      ax.legend(fontsize=7)
  save_figure(fig, path, dpi=110)


if __name__ == "__main__":
  app.run(main)
