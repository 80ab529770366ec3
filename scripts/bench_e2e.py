r"""End-to-end step time of each decoding method, per phase, on random weights.

  python -m scripts.bench_e2e --out_dir=results/h200 --models=qwen7b \
      --contexts=8192,16384,32768 --batches=16,8,1 --gammas=4

Methods (one process, warm compiled steps, random weights of the real shapes):
  vanilla       plain autoregressive decoding, our full-cache decode_attention
                kernel: THE baseline every speedup is stated against
  vanilla_xla   the same with plain XLA attention (the closest analogue of
                the paper's FlashAttention-2 baseline)
  sd_full       standard speculative decoding, full verification, full draft cache
  sd_magicdec   full verification, StreamingLLM draft cache (MagicDec)
  dustin        hybrid sparse verification, streaming draft cache
  streaming     sink + window verification, streaming draft cache
  quest         Quest page selection, streaming draft cache

Step time (`step_ms`, the basis of every speedup) is measured as the decode
loops of dustin_jax run: steps queued back to back with the host one step
ahead, then `block_until_ready`, divided by the steps. Also recorded:
`step_sync_ms` (each step waited for: + the host's dispatch) and `gpu_ms`
(GPU kernel time per step from a profiler trace). Per-phase times come from
the fused step's phases (its named scopes) in GPU kernel time, from a profiler trace.

Caches are filled with random values up to the context length; lengths
start at the context and grow by the committed tokens. All methods of one
(model, batch, gamma) share one cache buffer sized for the longest context
(+ the rows the timed steps commit), which the kernels read only up to
`lengths`; vanilla_xla reads the whole buffer, so it is timed only at the
longest context. Tokens/s = tau / step time, where tau is the mean accepted length
measured on the real offline pair (`--tau_json`, from scripts/eval_longctx.py
on the CPU); records say which tau was used and where it came from.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from configs import shapes
from dustin_jax import sharding
from dustin_jax.config import ModelConfig, append_xla_flags
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.speculative.step import SpecConfig, SpecState, bind_spec_step
from dustin_jax.vanilla import VanillaState, bind_vanilla_step
from scripts.benchmarking import (DeviceTimer, benchmark_pairs, compile_cache_from_flag,
                                  floor_bytes, floor_time, fresh_decode_state, phase_device_ms,
                                  pyplot, random_cache, random_model, save_figure, spec_state_at,
                                  write_json)

flags.DEFINE_string("out_dir", "results/h200", "where e2e.json and e2e.png go")
flags.DEFINE_list("models", ["qwen7b", "llama3_8b"], "qwen7b (7B + 0.5B) and/or llama3_8b (8B + 1B)")
flags.DEFINE_list("contexts", ["8192", "16384", "32768"], "context lengths")
flags.DEFINE_list("batches", ["16", "8", "1"], "batch sizes")
flags.DEFINE_list("gammas", ["4"], "draft lengths")
flags.DEFINE_list("methods", ["vanilla", "sd_full", "dustin", "sd_magicdec", "streaming",
                              "vanilla_xla", "quest"], "methods, in the order they run")
flags.DEFINE_list("phase_batches", ["16", "2"], "batches whose steps are also timed per phase")
flags.DEFINE_integer("mesh_model", 1, "tensor-parallel ways: both models and caches sharded by "
                     "heads over this many devices (1: one device)")
flags.DEFINE_integer("budget", 512, "KV budget of the sparse methods")
flags.DEFINE_integer("n_sink", 16, "attention-sink rows always verified")
flags.DEFINE_integer("n_window", 64, "recent rows always verified")
flags.DEFINE_integer("m", 128, "dustin: rows chosen by the draft signal")
flags.DEFINE_integer("repeats", 10, "timed steps per measurement (median)")
flags.DEFINE_integer("num_layers", 0, "keep only this many layers of both models (smoke runs)")
flags.DEFINE_list("target_layers", [], "time the target with only these many layers (the draft "
                  "whole), each in turn; with two or more counts, the step time of the whole "
                  "target is projected linearly in the layer count (records with "
                  "`projected_from`): how a 72B target is measured on one GPU")
flags.DEFINE_string("tau_json", "results/eval/tau.json", "tau per (policy, gamma, budget)")
flags.DEFINE_float("time_budget_s", 540, "stop starting new configs after this long")
flags.DEFINE_bool("smoke", False, "tiny shapes on CPU (schema test)")
flags.DEFINE_string("reprice", "", "an existing e2e.json: fill in tau, tokens/s and speedups "
                    "from --tau_json (no device needed), rewrite it and its plot")
flags.DEFINE_string("xla_flags", "", "appended to XLA_FLAGS before jax starts (e.g. "
                    "--xla_gpu_enable_command_buffer=... to try CUDA graphs)")
FLAGS = flags.FLAGS

POLICY = {"sd_full": "full", "sd_magicdec": "full", "dustin": "dustin", "streaming": "streaming",
          "quest": "quest"}


def _time_loop(step, carry, repeats):
  """Time `step(carry) -> (carry, out)` as a decode loop runs it, after two
  warm-up steps (the first compiles). Returns ({step_ms: steps queued back
  to back, the host one step ahead as in generate(), / steps;
  step_sync_ms: median of steps each waited for, host dispatch included;
  gpu_ms: GPU kernel time per step, None without a GPU}, carry)."""
  for _ in range(2):
    carry, out = step(carry)
    jax.block_until_ready(out)
  sync = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    carry, out = step(carry)
    jax.block_until_ready(out)
    sync.append(time.perf_counter() - t0)
  t0 = time.perf_counter()
  for _ in range(repeats):
    carry, out = step(carry)
  jax.block_until_ready(out)
  ahead = (time.perf_counter() - t0) / repeats
  with DeviceTimer() as timer:
    with timer.window("steps"):
      for _ in range(repeats):
        carry, out = step(carry)
      jax.block_until_ready(out)
  gpu = timer.ms("steps")
  return dict(step_ms=1e3 * ahead, step_sync_ms=1e3 * statistics.median(sync),
              gpu_ms=gpu[0] / repeats if gpu else None), carry


def bench_vanilla(target, cache, context, impl, repeats, mesh=None):
  """Times of the vanilla step (see `_time_loop`) and the cache. The cache
  lengths start at `context` and grow by one per step."""
  b = cache.batch
  step = bind_vanilla_step(target, impl=impl, mesh=mesh)
  start = VanillaState(cache.with_lengths(jnp.full((b,), context, jnp.int32)),
                       fresh_decode_state(b, mesh))
  times, st = _time_loop(step, start, repeats)
  return times, st.cache


def bench_spec(target, draft, tcache, dcache, context, cfg, repeats, phases=True):
  """(step times (see `_time_loop`), phase times or None, temp bytes of the
  compiled step, caches). Lengths start at `context` and grow as tokens are
  committed; the per-phase timing resets them to `context` every step."""
  st = spec_state_at(tcache, dcache, context, cfg.policy, cfg.mesh)
  full = st.target.lengths.copy()  # the step donates the state: kept for the resets
  step = bind_spec_step(target, draft, cfg)
  mem = step.lower(st).compile().memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
  times, st = _time_loop(step, st, repeats)
  if not phases:
    return times, None, temp, st.target, st.draft
  def reset(s):  # the step donates its whole state: hand it a fresh decode state
    return SpecState(s.target.with_lengths(full.copy()), s.draft.with_lengths(full.copy()),
                     fresh_decode_state(tcache.batch, cfg.mesh), s.signals)
  ph, st = phase_device_ms(step, reset(st), repeats, reset)
  return times, ph, temp, st.target, st.draft


def load_tau(path):
  if not path or not os.path.exists(path):
    return {}, None
  with open(path) as f:
    recs = json.load(f)
  return {(r["policy"], int(r["gamma"]), int(r.get("budget") or 0)): r for r in recs}, path


def price(rec, taus, tau_path, vanilla_step_ms, vanilla_gpu_ms=None):
  """tau (from the real pair), tokens/s and speedups of one record; also on
  GPU time (`gpu_speedup_vs_vanilla`): what a host that keeps up would see
  when a step is host-bound."""
  method = rec["method"]
  if method.startswith("vanilla"):
    rec.update(tau=1.0, tau_source="vanilla")
  else:
    pol = POLICY[method]
    t = taus.get((pol, rec["gamma"], rec["budget"] if pol != "full" else 0))
    rec.update(tau=t["tau"] if t else None,
               tau_source=(f"{tau_path}: real pair qwen2.5-coder-1.5b + 0.5b, "
                           f"context {t.get('context')}, {t.get('source', '')}"
                           + ("" if method == "sd_full" else
                              "; measured with a full-cache draft (this method's streaming "
                              "draft cache was not used for tau)") if t else "not measured"))
  tau = rec["tau"]
  rec["tokens_per_s"] = rec["batch"] * tau / (rec["step_ms"] / 1e3) if tau else None
  rec["speedup_vs_vanilla"] = tau * vanilla_step_ms / rec["step_ms"] if tau and vanilla_step_ms else None
  rec["step_speedup_vs_vanilla"] = vanilla_step_ms / rec["step_ms"] if vanilla_step_ms else None
  gpu = rec.get("gpu_ms")
  rec["gpu_speedup_vs_vanilla"] = (tau * vanilla_gpu_ms / gpu if tau and gpu and vanilla_gpu_ms
                                   else None)


def price_all(records, taus, tau_path):
  """`price` every timed record against the vanilla step of its own (model,
  target layers, batch, gamma, context), measured in the same run (one
  process) where that run has one, else in the latest run that has one;
  `vanilla_run` names the run used."""
  where = lambda r: (r["model"], r.get("target_layers"), r["batch"], r["gamma"], r["context"])
  vanilla = {}
  for r in sorted((r for r in records if r.get("method") == "vanilla" and r.get("step_ms")),
                  key=lambda r: r.get("run") or ""):
    vanilla[(r.get("run"),) + where(r)] = vanilla[where(r)] = r  # later runs win the fallback
  for r in records:
    if r.get("step_ms"):
      v = vanilla.get((r.get("run"),) + where(r)) or vanilla.get(where(r), {})
      price(r, taus, tau_path, v.get("step_ms"), v.get("gpu_ms"))
      if r.get("run") or v.get("run"):
        r["vanilla_run"] = v.get("run")


def reprice(path):
  taus, tau_path = load_tau(FLAGS.tau_json)
  with open(path) as f:
    records = [r for r in json.load(f) if not r.get("projected_from")]
  records += project_layers(records, sorted({r["model"] for r in records if r.get("model")}))
  price_all(records, taus, tau_path)
  refloor(records)
  write_json(path, records)
  _finish(records, path)


def method_policy(method, tcfg, dcfg, budget):
  """The selection policy a method runs with (None: vanilla)."""
  if method not in POLICY:
    return None
  return policy_from_config(dict(policy=POLICY[method], budget=budget, n_sink=FLAGS.n_sink,
                                 n_window=FLAGS.n_window, m=FLAGS.m), tcfg, dcfg)


def refloor(records):
  """Recompute `floor_bytes` (and `floor_ms`, `floor_share`) of the records
  of known shapes: the floor is a property of the configuration, so records
  measured before a fix of the count get the fixed one."""
  for r in records:
    if "floor_bytes" not in r or r.get("model") not in shapes.PAIRS:
      continue
    thf, dhf = shapes.PAIRS[r["model"]]
    tcfg = ModelConfig.from_hf(dict(thf), dtype="bfloat16", num_layers=r.get("target_layers"))
    dcfg = ModelConfig.from_hf(dict(dhf), dtype="bfloat16")
    budget = r.get("budget") or FLAGS.budget
    r["floor_bytes"] = floor_bytes(r["method"], tcfg, dcfg, r["batch"], r["context"], r["gamma"],
                                   budget, method_policy(r["method"], tcfg, dcfg, budget),
                                   ways=r.get("devices") or 1)
    floor_time(r)


def main(argv):
  del argv
  if FLAGS.reprice:
    return reprice(FLAGS.reprice)
  append_xla_flags(FLAGS.xla_flags)
  # the step's memory statistics come from an AOT compile; with the cache
  # the jitted call that follows loads that executable instead of compiling again
  compile_cache_from_flag()
  t_start = time.perf_counter()
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  out_json = os.path.join(FLAGS.out_dir, "e2e.json")
  taus, tau_path = load_tau(FLAGS.tau_json)
  contexts = sorted(int(x) for x in FLAGS.contexts)
  if FLAGS.smoke:
    contexts = [48, 96]
  max_ctx = max(contexts)
  records = []
  device = jax.devices()[0].device_kind
  cap = sharding.device_capacity()
  mesh = sharding.make_mesh(1, FLAGS.mesh_model) if FLAGS.mesh_model > 1 else None
  dmesh = sharding.draft_mesh(mesh)
  save = lambda: write_json(out_json, records)
  runs = [(name, int(tl) if tl else None) for name in FLAGS.models
          for tl in (FLAGS.target_layers or [""])]
  for name, target_layers in runs:
    thf, dhf = benchmark_pairs(FLAGS.smoke)[name]
    layers = FLAGS.num_layers or None
    tcfg = ModelConfig.from_hf(dict(thf), dtype="bfloat16", num_layers=target_layers or layers)
    dcfg = ModelConfig.from_hf(dict(dhf), dtype="bfloat16", num_layers=layers)
    target, draft = random_model(tcfg, 0, mesh), random_model(dcfg, 1, dmesh)
    tcfg, dcfg = target.cfg, draft.cfg
    for batch in (int(b) for b in FLAGS.batches):
      for gamma in (int(g) for g in FLAGS.gammas):
        # room for the rows the timed steps commit: lengths grow from `context`
        # over _time_loop's steps (the phase timing resets them), + 4 spare steps
        committed_steps = 2 + 3 * FLAGS.repeats
        max_len = max_ctx + (committed_steps + 4) * (gamma + 1) + 8
        plan = sharding.memory_plan(tcfg, dcfg, batch=batch, max_len=max_len, data=1,
                                    model=FLAGS.mesh_model, gamma=gamma, capacity=cap)
        if not plan.fits():
          print(f"skip {name} batch {batch}: {plan.total / 2**30:.0f} GiB > "
                f"{plan.capacity / 2**30:.0f} GiB (XLA_PYTHON_CLIENT_MEM_FRACTION raises the "
                "allocator's share)", flush=True)
          records.append(dict(method="*", model=name, batch=batch, gamma=gamma, skipped="memory",
                              need_gib=plan.total / 2**30))
          continue
        caches = lambda: (random_cache(tcfg, batch, max_len, max_ctx, 11, mesh=mesh),
                          random_cache(dcfg, batch, max_len, max_ctx, 13, mesh=dmesh))
        tcache, dcache = caches()
        vanilla_ms = {}
        for method in FLAGS.methods:
          if time.perf_counter() - t_start > FLAGS.time_budget_s:
            print("time budget reached; stopping", flush=True)
            save()
            return _finish(records, out_json)
          policy = method_policy(method, tcfg, dcfg, FLAGS.budget)
          for context in contexts:
            if method == "vanilla_xla" and context != max_ctx:
              continue  # XLA reads the whole buffer: only fair where context fills it
            rec = dict(method=method, model=name, batch=batch, context=context, gamma=gamma,
                       budget=FLAGS.budget if method in ("dustin", "streaming", "quest") else None,
                       target_layers=tcfg.num_layers, device=device,
                       devices=len(tcache.k[0].sharding.device_set),  # the cache's, as placed
                       jax_version=jax.__version__,
                       xla_flags=os.environ.get("XLA_FLAGS", ""))
            try:
              if method.startswith("vanilla"):
                impl = "reference" if method == "vanilla_xla" else "auto"
                times, tcache = bench_vanilla(target, tcache, context, impl, FLAGS.repeats, mesh)
                rec.update(times, phase_ms={"verify": times["gpu_ms"] or times["step_ms"]})
                vanilla_ms[(method, context)] = times["step_ms"]
              else:
                cfg = SpecConfig(gamma=gamma, policy=policy, mesh=mesh,
                                 draft_kv="full" if method == "sd_full" else "streaming")
                times, phases, temp, tcache, dcache = bench_spec(
                    target, draft, tcache, dcache, context, cfg, FLAGS.repeats,
                    phases=str(batch) in FLAGS.phase_batches)
                rec.update(times, phase_ms=phases, compiled_temp_bytes=temp)
              rec["floor_bytes"] = floor_bytes(method, tcfg, dcfg, batch, context, gamma,
                                               FLAGS.budget, policy, ways=FLAGS.mesh_model)
              floor_time(rec)
              price(rec, taus, tau_path, vanilla_ms.get(("vanilla", context)))
            except Exception as e:  # noqa: BLE001 -- record and go on: one bad config
              rec["error"] = f"{type(e).__name__}: {e}"[:500]
              # a failed call may have consumed the donated caches: make new ones
              tcache, dcache = caches()
            records.append(rec)
            print(json.dumps({k: rec.get(k) for k in ("method", "model", "batch", "context",
                              "gamma", "step_ms", "phase_ms", "speedup_vs_vanilla", "error")}),
                  flush=True)
            save()
        del tcache, dcache
    del target, draft
  records += project_layers(records, FLAGS.models)
  price_all(records, taus, tau_path)
  save()
  _finish(records, out_json)


def project_layers(records, models):
  """Step time of the whole target from runs with fewer target layers: the
  step is linear in the target's layer count (each layer adds its weights,
  KV rows and kernels; the draft and the LM heads are fixed), so two counts
  give the line. Unpriced records marked `projected_from`."""
  out = []
  ok = [r for r in records if r.get("step_ms") and not r.get("error")]
  keys = {(r["method"], r["model"], r["batch"], r["context"], r["gamma"]) for r in ok}
  pairs = benchmark_pairs(FLAGS.smoke)
  full_layers = {m: pairs[m][0]["num_hidden_layers"] for m in models if m in pairs}
  for key in sorted(keys):
    if key[1] not in full_layers:
      continue
    pts = sorted({r["target_layers"]: r for r in ok if
                  (r["method"], r["model"], r["batch"], r["context"], r["gamma"]) == key}.items())
    n_full = full_layers[key[1]]
    if len(pts) < 2 or pts[-1][0] >= n_full:
      continue
    (l1, r1), (l2, r2) = pts[0], pts[-1]
    rec = {k: r2[k] for k in ("method", "model", "batch", "context", "gamma", "budget", "device",
                              "jax_version", "xla_flags")}
    at = lambda a, b: a + (b - a) * (n_full - l1) / (l2 - l1)
    rec.update(target_layers=n_full, projected_from=[l1, l2],
               step_ms=at(r1["step_ms"], r2["step_ms"]))
    if r1.get("phase_ms") and r2.get("phase_ms"):
      rec["phase_ms"] = {p: at(r1["phase_ms"][p], r2["phase_ms"][p]) for p in r2["phase_ms"]
                         if isinstance(r2["phase_ms"][p], float) and p in r1["phase_ms"]}
    out.append(rec)
  return out


def _finish(records, out_json):
  save_plot(records, out_json.replace(".json", ".png"))
  print(f"wrote {out_json}")


def save_plot(records, path):
  ok = [r for r in records if r.get("step_ms") and not r.get("error")]
  if not ok:
    return
  # one line per (method, model, batch, gamma, layers): the points of the
  # latest run that measured it (no line mixes runs)
  series = lambda r: (r["method"], r["model"], r["batch"], r["gamma"], r.get("target_layers"),
                      bool(r.get("projected_from")))
  latest = {series(r): r.get("run") or "" for r in sorted(ok, key=lambda r: r.get("run") or "")}
  ok = [r for r in ok if (r.get("run") or "") == latest[series(r)]]
  models = sorted({r["model"] for r in ok})
  fig, axes = pyplot().subplots(1, len(models), figsize=(10 * len(models), 5.5), squeeze=False)
  for ax, m in zip(axes[0], models):
    line = lambda r: (r["method"], r["batch"], r["gamma"], r.get("target_layers") or 0,
                      bool(r.get("projected_from")))
    for key in sorted({line(r) for r in ok if r["model"] == m and r["method"] != "vanilla"}):
      method, batch, gamma, layers, projected = key
      pts = sorted((r["context"], r.get("speedup_vs_vanilla") or r.get("step_speedup_vs_vanilla"))
                   for r in ok if r["model"] == m and line(r) == key)
      pts = [p for p in pts if p[1]]
      label = f"{method} B{batch} γ{gamma}" + (f" {layers} layers" if layers else "")
      if not pts:
        continue
      # colour: method; line: batch; marker: gamma
      style = dict(color=_METHOD_COLOR.get(method, "black"),
                   ls="-." if projected else _BATCH_LS.get(batch, "-"),
                   marker=_GAMMA_MARKER.get(gamma, "o"))
      ax.plot(*zip(*pts), label=label + (" (projected)" if projected else ""), **style)
      gpu = [] if method != "dustin" or projected else sorted(
          (r["context"], r["gpu_speedup_vs_vanilla"]) for r in ok
          if r["model"] == m and line(r) == key and r.get("gpu_speedup_vs_vanilla"))
      if any(g > 1.03 * s for (_, g), (_, s) in zip(gpu, pts)):
        # a host-bound dustin step (default XLA flags): its GPU time too
        ax.plot(*zip(*gpu), color=style["color"], ls=":", marker="x", lw=0.8,
                label=label + " on GPU time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speedup vs vanilla (tokens/s; step time where tau unknown)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_title(f"{m} on {ok[0]['device']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  save_figure(fig, path)


_METHOD_COLOR = {"dustin": "tab:red", "sd_full": "tab:blue", "sd_magicdec": "tab:cyan",
                 "streaming": "tab:green", "quest": "tab:purple", "vanilla_xla": "tab:gray"}
_BATCH_LS = {16: "-", 8: (0, (5, 2)), 1: (0, (1, 1))}
_GAMMA_MARKER = {4: "o", 2: "s", 6: "^"}


if __name__ == "__main__":
  app.run(main)
