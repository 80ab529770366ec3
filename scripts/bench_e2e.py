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

`step_ms`, the basis of every speedup, times steps as the decode loops run
them: queued back to back, the host ahead; it is the time each further step
of a long decode adds (the slope between the fastest of three queues of
`--repeats` and of 3x as many steps), so the first step's dispatch, paid
once per decode, is not spread over a few steps (`step_resolved`: False
where steps far shorter than the timing noise left no slope, and step_ms is
then queued_ms, an upper bound). Also recorded:
`queued_ms` (the mean of `--repeats` queued steps, that dispatch
included), `host_ms` (the host's time to queue one step), `step_sync_ms`
(each step waited for: + the host's dispatch), `gpu_ms` and,
for `--phase_batches`, `phase_ms` per named scope of the fused step (GPU kernel
time, from profiler traces). A 72B target runs tensor-parallel: `--mesh_model=2`.

Caches hold random rows; lengths start at the context and grow by the
committed tokens. The methods of one (model, batch, gamma) share one cache
sized for the longest context, read only up to `lengths` (vanilla_xla reads it
whole: it runs only at the longest context). Tokens/s = tau / step time, tau
the mean accepted length of the real pair with the draft cache the method
runs (`--tau_json` at `--tau_context`, from scripts/eval_longctx.py), named
in each record; speedups are against the
vanilla step of the same (model, batch, gamma, context) in this process.
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

from dustin_jax import sharding
from dustin_jax.config import ModelConfig, append_xla_flags
from dustin_jax.decoding import resolve_draft_mlp
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.speculative.step import SpecConfig, SpecState, bind_spec_step
from dustin_jax.vanilla import VanillaState, bind_vanilla_step
from kernels.common import round_up
from scripts.benchmarking import (DeviceTimer, benchmark_pairs, compile_cache_from_flag,
                                  floor_bytes, floor_time, fresh_decode_state, graph_mode,
                                  measure_copy_tbs, phase_device_ms, pyplot, queued_steps,
                                  random_cache, random_model, save_figure, spec_state_at,
                                  steady_step_count, steady_step_seconds, tau_draft_cache,
                                  write_json)

flags.DEFINE_string("out_dir", "results/h200", "where e2e.json and e2e.png go")
flags.DEFINE_string("json_name", "e2e.json", "the JSON's file name in out_dir (the PNG's: "
                    "the same with .png); one per process when several write to one folder")
flags.DEFINE_list("models", ["qwen7b", "llama3_8b"], "pairs of configs.shapes.PAIRS")
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
flags.DEFINE_integer("repeats", 10, "steps per short queue (step_ms: the slope to queues "
                     "of 3x as many) and per sync / GPU-time measurement")
flags.DEFINE_integer("num_layers", 0, "keep only this many layers of both models (smoke runs)")
flags.DEFINE_string("tau_json", "results/eval/tau.json", "tau per (policy, gamma, budget)")
flags.DEFINE_integer("tau_context", 4096, "the context whose tau records price the runs (the "
                     "real pair's tau is measured on the CPU at a few thousand tokens)")
flags.DEFINE_float("time_budget_s", 540, "stop starting new configs after this long")
flags.DEFINE_list("draft_mlps", ["auto"], "the draft's MLPs, each timed per speculative "
                  "method: auto | xla (its GEMMs) | kernel (kernels.swiglu_mlp, Hopper) | "
                  "kernel_prefetch (the kernel, sending the next layer's q/k/v and o to "
                  "L2; auto: wherever it runs, as the CLI) | seam | seam_mosaic (see "
                  "dustin_jax.decoding.resolve_draft_mlp)")
flags.DEFINE_list("draft_heads", ["int8"], "the draft's LM head, each timed per speculative "
                  "method: int8 (int8 rows with per-row scales, as the CLI) | native (its own "
                  "matrix); dustin_jax.decoding.Model.with_draft_head")
flags.DEFINE_list("draft_windows", [str(SpecConfig().draft_window)], "recent rows of the "
                  "streaming draft cache (after its sink rows), each timed per method that "
                  "streams its draft and priced with the tau measured at that window")
flags.DEFINE_bool("smoke", False, "tiny shapes on CPU (schema test)")
flags.DEFINE_string("xla_flags", "", "appended to XLA_FLAGS before jax starts (e.g. "
                    "--xla_gpu_enable_command_buffer=... to try CUDA graphs)")
FLAGS = flags.FLAGS

# dustin_draft / dustin_target: the method with one signal only (the whole
# free budget by it), what each signal's scoring and selection cost the step
POLICY = {"sd_full": "full", "sd_magicdec": "full", "dustin": "dustin", "streaming": "streaming",
          "quest": "quest", "dustin_draft": "dustin_draft", "dustin_target": "dustin_target"}
SPARSE = tuple(m for m, p in POLICY.items() if p != "full")  # verify within --budget


def _time_loop(step, carry, repeats):
  """({step_ms: per step of a long decode, steps queued back to back with
  the host ahead (`steady_step_seconds`; step_resolved: False where noise
  hid the slope and step_ms is queued_ms); queued_ms: the mean of `repeats`
  queued steps, the first one's dispatch included; host_ms: the host's time
  to queue one; step_sync_ms: median of steps each waited for, host
  dispatch included; gpu_ms: GPU kernel time per step, None without a GPU},
  carry) of `step(carry) -> (carry, out)`, after two warm-up steps."""
  sync = []  # the first two steps compile and warm up: not counted
  for _ in range(2 + repeats):
    t0 = time.perf_counter()
    carry, out = step(carry)
    jax.block_until_ready(out)
    sync.append(time.perf_counter() - t0)
  carry, ahead = steady_step_seconds(step, carry, repeats)
  with DeviceTimer() as timer:
    with timer.window("steps"):
      carry, _, _ = queued_steps(step, carry, repeats)
  gpu = timer.ms("steps")
  return dict(step_ms=1e3 * ahead["step"], step_resolved=ahead["resolved"],
              queued_ms=1e3 * ahead["queued"],
              host_ms=1e3 * ahead["host"], step_sync_ms=1e3 * statistics.median(sync[2:]),
              gpu_ms=gpu[0] / repeats if gpu else None), carry


def bench_vanilla(target, cache, context, impl, repeats, mesh=None):
  """(the record's times (see `_time_loop`), all in the "verify" phase; the
  cache). The cache lengths start at `context` and grow by one per step."""
  b = cache.batch
  step = bind_vanilla_step(target, impl=impl, mesh=mesh)
  start = VanillaState(cache.with_lengths(jnp.full((b,), context, jnp.int32)),
                       fresh_decode_state(b, mesh))
  times, st = _time_loop(step, start, repeats)
  return dict(times, phase_ms={"verify": times["gpu_ms"] or times["step_ms"]}), st.cache


def bench_spec(target, draft, tcache, dcache, context, cfg, repeats, phases=True):
  """(the record's times (see `_time_loop`), phases (None unless `phases`)
  and compiled temp bytes; the caches). Lengths start at `context` and grow as tokens are
  committed; the per-phase timing resets them to `context` every step."""
  st = spec_state_at(tcache, dcache, context, cfg.policy, cfg.mesh)
  full = st.target.lengths.copy()  # the step donates the state: kept for the resets
  step = bind_spec_step(target, draft, cfg)
  mem = step.lower(st).compile().memory_analysis()  # None where the backend has none
  temp = int(getattr(mem, "temp_size_in_bytes", -1))
  times, st = _time_loop(step, st, repeats)
  phase_ms = None
  if phases:
    def reset(s):  # the step donates its whole state: hand it a fresh decode state
      return SpecState(s.target.with_lengths(full.copy()), s.draft.with_lengths(full.copy()),
                       fresh_decode_state(tcache.batch, cfg.mesh), s.signals)
    phase_ms, st = phase_device_ms(step, reset(st), repeats, reset)
  return (dict(times, phase_ms=phase_ms, graph=graph_mode(), compiled_temp_bytes=temp),
          st.target, st.draft)


full_draft = ("full", None, None)


def price_all(records, taus, tau_path):
  """tau, tokens/s and speedups of every timed record against the vanilla
  step of its (model, batch, gamma, context); also on GPU time: what a host
  that keeps up would see of a host-bound step."""
  where = lambda r: (r["model"], r["batch"], r["gamma"], r["context"])
  vanilla = {where(r): r for r in records if r["method"] == "vanilla" and r.get("step_ms")}
  # every method but sd_full runs a streaming draft cache of SpecConfig's sink and window
  for r in (r for r in records if r.get("step_ms")):
    method, v = r["method"], vanilla.get(where(r), {})
    if method.startswith("vanilla"):
      r.update(tau=1.0, tau_source="vanilla")
    else:
      pol = POLICY[method]
      key = (pol, r["gamma"], r["budget"] if pol != "full" else 0)
      streaming = method != "sd_full"
      head = r.get("draft_head") or "native"
      cache = ("streaming", r["draft_sink"], r["draft_window"]) if streaming else full_draft
      # the tau measured with this method's draft (cache and head), else with
      # its cache and the native head, else the full-cache native draft's
      t = next((taus[key + d] for d in (cache + (head,), cache + ("native",),
                                        full_draft + ("native",)) if key + d in taus), None)
      source = (f"{tau_path}: real pair qwen2.5-coder-1.5b + 0.5b, context {t.get('context')}, "
                f"{t.get('source', '')}" if t else "not measured")
      if t and tau_draft_cache(t)[:3] != cache:
        source += ("; measured with a full-cache draft (this method's streaming draft cache "
                   "was not used for tau)")
      elif t and streaming:
        source += (f"; measured with a streaming draft cache ({t.get('draft_sink')} sink + "
                   f"{t.get('draft_window')} recent rows)")
      if t and tau_draft_cache(t)[3] != head:
        source += f"; measured with the draft's native LM head (this run's: {head})"
      r.update(tau=t["tau"] if t else None, tau_source=source)
    tau, step, gpu = r["tau"], r["step_ms"], r.get("gpu_ms")
    v_step, v_gpu = v.get("step_ms"), v.get("gpu_ms")
    r["tokens_per_s"] = r["batch"] * tau / (step / 1e3) if tau else None
    r["speedup_vs_vanilla"] = tau * v_step / step if tau and v_step else None
    r["step_speedup_vs_vanilla"] = v_step / step if v_step else None
    r["gpu_speedup_vs_vanilla"] = tau * v_gpu / gpu if tau and gpu and v_gpu else None


def bench_model(name, contexts, mesh, deadline, records, save, copy_tbs=None):
  """Append a record per (batch, gamma, method, context) of model pair
  `name` to `records`, calling `save()` after each; False once past
  `deadline` (no new method is started then). `copy_tbs`: the copy
  bandwidth measured in this process, the floor's yardstick."""
  thf, dhf = benchmark_pairs(FLAGS.smoke)[name]
  layers = FLAGS.num_layers or None
  tcfg = ModelConfig.from_hf(dict(thf), dtype="bfloat16", num_layers=layers)
  dcfg = ModelConfig.from_hf(dict(dhf), dtype="bfloat16", num_layers=layers)
  dmesh = sharding.draft_mesh(mesh)
  target = random_model(tcfg, 0, mesh)
  drafts = {}  # (MLP mode, LM head) -> the draft: the same weights in each
  for mode in dict.fromkeys(resolve_draft_mlp(m, dcfg, mesh) for m in FLAGS.draft_mlps):
    draft = random_model(dcfg, 1, dmesh).with_draft_mlp(mode)
    for head in dict.fromkeys(FLAGS.draft_heads):
      drafts[mode, head] = draft.with_draft_head(head)
  tcfg, dcfg = target.cfg, draft.cfg
  max_ctx = max(contexts)
  for batch in (int(b) for b in FLAGS.batches):
    for gamma in (int(g) for g in FLAGS.gammas):
      # room for the rows the timed steps commit: lengths grow from `context`
      # over _time_loop's steps (2 + 2 x repeats + the steady measurement's;
      # the phase timing resets them), + 4 spare
      timed = 2 + 2 * FLAGS.repeats + steady_step_count(FLAGS.repeats)
      # whole tiles of rows (TMA kernels want a multiple of 8)
      max_len = round_up(max_ctx + (timed + 4) * (gamma + 1) + 8, 128)
      plan = sharding.memory_plan(tcfg, dcfg, batch=batch, max_len=max_len, data=1,
                                  model=FLAGS.mesh_model, gamma=gamma,
                                  capacity=sharding.device_capacity())
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
      for method in FLAGS.methods:
        if time.perf_counter() > deadline:
          return False
        policy = None  # vanilla's
        if method in POLICY:
          policy = policy_from_config(dict(policy=POLICY[method], budget=FLAGS.budget,
                                           n_sink=FLAGS.n_sink, n_window=FLAGS.n_window,
                                           m=FLAGS.m), tcfg, dcfg)
        windows = [None] if method == "sd_full" else [int(w) for w in FLAGS.draft_windows]
        runs = [(c, (None, None), None) for c in contexts] if method.startswith("vanilla") else [
            (c, variant, w) for c in contexts for variant in drafts for w in windows]
        for context, (draft_mlp, draft_head), window in runs:
          if method == "vanilla_xla" and context != max_ctx:
            continue  # XLA reads the whole buffer: only fair where context fills it
          rec = dict(method=method, model=name, batch=batch, context=context, gamma=gamma,
                     budget=FLAGS.budget if method in SPARSE else None, draft_mlp=draft_mlp,
                     draft_head=draft_head,
                     draft_sink=SpecConfig().draft_sink if window is not None else None,
                     draft_window=window,
                     target_layers=tcfg.num_layers, device=jax.devices()[0].device_kind,
                     devices=len(tcache.k[0].sharding.device_set),  # the cache's, as placed
                     jax_version=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""))
          try:
            if method.startswith("vanilla"):
              impl = "reference" if method == "vanilla_xla" else "auto"
              times, tcache = bench_vanilla(target, tcache, context, impl, FLAGS.repeats, mesh)
            else:
              cfg = SpecConfig(gamma=gamma, policy=policy, mesh=mesh,
                               draft_kv="full" if method == "sd_full" else "streaming",
                               draft_window=window if window is not None else
                               SpecConfig().draft_window)
              times, tcache, dcache = bench_spec(target, drafts[draft_mlp, draft_head], tcache, dcache,
                                                 context, cfg,
                                                 FLAGS.repeats, str(batch) in FLAGS.phase_batches)
            rec.update(times)
            rec["floor_bytes"] = floor_bytes(method, tcfg, dcfg, batch, context, gamma,
                                             FLAGS.budget, policy, ways=FLAGS.mesh_model,
                                             draft_rows=cfg.draft_sink + cfg.draft_window
                                             if window is not None else None,
                                             draft_head=draft_head or "native")
            floor_time(rec, copy_tbs)
          except Exception as e:  # noqa: BLE001 -- record and go on: one bad config
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
            # a failed call may have consumed the donated caches: make new ones
            tcache, dcache = caches()
          records.append(rec)
          save()
          print(json.dumps({k: rec.get(k) for k in ("method", "model", "batch", "context",
                            "gamma", "draft_window", "step_ms", "phase_ms", "speedup_vs_vanilla",
                            "error")}),
                flush=True)
      del tcache, dcache  # before the next (batch, gamma) makes its own
  return True


def main(_):
  append_xla_flags(FLAGS.xla_flags)
  # the step's memory statistics come from an AOT compile; with the cache
  # the jitted call that follows loads that executable instead of compiling again
  compile_cache_from_flag()
  deadline = time.perf_counter() + FLAGS.time_budget_s
  out_json = os.path.join(FLAGS.out_dir, FLAGS.json_name)
  # (policy, gamma, budget, draft cache) -> tau record
  taus, tau_path = {}, FLAGS.tau_json
  if tau_path and os.path.exists(tau_path):
    with open(tau_path) as f:
      taus = {(r["policy"], int(r["gamma"]), int(r.get("budget") or 0)) + tau_draft_cache(r): r
              for r in json.load(f) if r.get("context", FLAGS.tau_context) == FLAGS.tau_context}
  contexts = [48, 96] if FLAGS.smoke else sorted(int(x) for x in FLAGS.contexts)
  mesh = sharding.make_mesh(1, FLAGS.mesh_model) if FLAGS.mesh_model > 1 else None
  # the floor's yardstick, measured in this process before any model is placed
  copy_tbs = None
  if jax.default_backend() == "gpu":
    try:
      copy_tbs = measure_copy_tbs()
    except Exception as e:  # noqa: BLE001 -- the records then say copy_source=COPY_TBS
      print(f"measure_copy_tbs failed: {type(e).__name__}: {e}", flush=True)
  print(f"copy bandwidth {copy_tbs:.3f} TB/s" if copy_tbs else
        "copy bandwidth not measured: the floor uses COPY_TBS where it knows the device",
        flush=True)
  records = []
  def save():
    price_all(records, taus, tau_path)
    write_json(out_json, records)
  for name in FLAGS.models:
    if not bench_model(name, contexts, mesh, deadline, records, save, copy_tbs):
      print("time budget reached; stopping", flush=True)
      break
  save()
  save_plot(records, out_json.replace(".json", ".png"))
  print(f"wrote {out_json}")


_METHOD_COLOR = {"dustin": "tab:red", "sd_full": "tab:blue", "sd_magicdec": "tab:cyan",
                 "streaming": "tab:green", "quest": "tab:purple", "vanilla_xla": "tab:gray",
                 "dustin_draft": "tab:orange", "dustin_target": "tab:brown"}
_BATCH_LS = {16: "-", 8: (0, (5, 2)), 1: (0, (1, 1))}
_GAMMA_MARKER = {4: "o", 2: "s", 6: "^"}


def save_plot(records, path):
  """Speedup vs vanilla over context: a panel per model, a line per (method,
  batch, gamma): colour the method, line style the batch, marker gamma."""
  panels = {}  # model -> {(method, batch, gamma): its records, by context}
  for r in sorted(records, key=lambda r: r.get("context", 0)):
    if r.get("step_ms") and not r.get("error") and r["method"] != "vanilla":
      series = panels.setdefault(r["model"], {})
      head = r.get("draft_head") or "native"
      series.setdefault((r["method"], r["batch"], r["gamma"], head), []).append(r)
  if not panels:
    return
  fig, axes = pyplot().subplots(1, len(panels), figsize=(10 * len(panels), 5.5), squeeze=False)
  for ax, (model, series) in zip(axes[0], sorted(panels.items())):
    for (method, batch, gamma, head), line in sorted(series.items()):
      pts = [(r["context"], r["speedup_vs_vanilla"] or r["step_speedup_vs_vanilla"])
             for r in line]
      pts = [p for p in pts if p[1]]
      if not pts:
        continue
      label = f"{method} B{batch} γ{gamma}" + ("" if head == "native" else f" {head} head")
      color = _METHOD_COLOR.get(method, "black")
      ax.plot(*zip(*pts), label=label, color=color, ls=_BATCH_LS.get(batch, "-"),
              marker=_GAMMA_MARKER.get(gamma, "o"))
      gpu = [r for r in line if r["gpu_speedup_vs_vanilla"]]
      if method == "dustin" and any(
          r["gpu_speedup_vs_vanilla"] > 1.03 * r["speedup_vs_vanilla"] for r in gpu):
        # a host-bound dustin step (default XLA flags): its speedup on GPU time too
        ax.plot([r["context"] for r in gpu], [r["gpu_speedup_vs_vanilla"] for r in gpu],
                color=color, ls=":", marker="x", lw=0.8, label=label + " on GPU time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speedup vs vanilla (tokens/s; step time where tau unknown)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_title(f"{model} on {jax.devices()[0].device_kind}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  save_figure(fig, path)


if __name__ == "__main__":
  app.run(main)
