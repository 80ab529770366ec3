r"""Where the time of one decoding step goes: device time per kernel.

  python -m scripts.trace_step --out_dir=results/h200 --context=32768 --batch=16

Runs the vanilla step and the dustin step (random weights of a benchmark
pair's shapes, `--model`, over `--mesh_model` devices; caches filled to
`context`): the step time as the decode loops
run it (no profiler), then under the JAX profiler the GPU kernel time per
kernel name (GPU busy time = the union of kernel intervals; launches) and
the host time per traced host event (where dispatch time goes when the step
is host-bound). Writes trace_step.json, with the dustin step's GPU time per phase (the
step's named scopes), each of its kernels' JAX source (`source`: the named
scopes, primitive and function chain of its HLO instruction) and its GPU time
summed by source function (`by_source`); `--save_hlo` also writes its
compiled HLO.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import tempfile
import time

from absl import app
from absl import flags
import jax

from configs import shapes
from dustin_jax import sharding
from dustin_jax.config import ModelConfig, append_xla_flags
from dustin_jax.decoding import DRAFT_HEADS, DRAFT_MLPS, resolve_draft_mlp
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.speculative.step import SpecConfig, bind_spec_step
from dustin_jax.vanilla import VanillaState, bind_vanilla_step
from kernels.common import round_up
from scripts.benchmarking import (attribute_phases, busy_time, compile_cache_from_flag,
                                  device_events, fresh_decode_state, graph_mode, hlo_op_names,
                                  hlo_phases, load_trace_events, plot_timeline, random_cache,
                                  random_model, short_source, spec_state_at,
                                  steady_step_count, steady_step_seconds, time_by_source,
                                  timeline, write_json)

flags.DEFINE_string("out_dir", "results/h200", "where trace_step.json goes")
flags.DEFINE_string("model", "qwen7b", "target + draft shapes: qwen7b, llama3_8b or qwen72b")
flags.DEFINE_integer("mesh_model", 1, "tensor-parallel ways (the target sharded, the draft "
                     "whole on every device, as in bench_e2e)")
flags.DEFINE_integer("context", 32768, "context length")
flags.DEFINE_integer("batch", 16, "batch size")
flags.DEFINE_integer("gamma", 4, "draft length")
flags.DEFINE_integer("steps", 3, "profiled steps per method")
flags.DEFINE_integer("top", 25, "kernels listed per method")
flags.DEFINE_list("methods", ["vanilla", "dustin"], "steps profiled: vanilla and/or dustin")
flags.DEFINE_integer("asrun_steps", 20, "steps queued back to back for step_ms (no profiler; "
                     "the slope between the fastest of three queues of this many and of 3x "
                     "as many)")
flags.DEFINE_string("out_name", "trace_step.json", "output file in out_dir")
flags.DEFINE_string("xla_flags", "", "appended to XLA_FLAGS before jax starts")
flags.DEFINE_bool("save_hlo", False, "also write the dustin step's compiled HLO text "
                  "(<out_name>.hlo.txt.gz): what each fused kernel computes")
flags.DEFINE_enum("draft_mlp", "auto", list(DRAFT_MLPS), "the draft's MLPs: XLA's "
                  "GEMMs, one kernel per layer pass (kernels.swiglu_mlp, Hopper), that "
                  "kernel sending the next layer's q/k/v and o to L2, or auto (the "
                  "latter wherever it runs, as the CLI)")
flags.DEFINE_enum("draft_head", "int8", list(DRAFT_HEADS), "the draft's LM head: int8 rows "
                  "with per-row scales (as the CLI) or its own matrix")
flags.DEFINE_bool("timeline", False, "also write the dustin steps' kernels in start order "
                  "(<out_name>.timeline.json.gz: start and duration in us from the first "
                  "kernel, stream, kernel name, phase) and their plot (.timeline.png): "
                  "what runs beside what in a concurrent graph")
flags.DEFINE_bool("smoke", False, "tiny shapes (CPU)")
FLAGS = flags.FLAGS


def profile(fn, steps, phase_of=None, source_of=None):
  """`fn()` runs one step and returns its output. Three measures:
  `step_ms`, what each further step of a long decode adds, steps queued back
  to back with the host ahead as the decode loops run them
  (`steady_step_seconds`), without the profiler (whose per-launch tracing
  slows the host); then, under the profiler, `steps` steps queued and waited for
  at the end: GPU time per kernel name and host time per traced host event
  (what the host does while dispatching)."""
  jax.block_until_ready(fn())  # compile + warm up
  jax.block_until_ready(fn())
  step = steady_step_seconds(lambda c: (c, fn()), None, FLAGS.asrun_steps)[1]["step"]
  d = tempfile.mkdtemp(prefix="prof_step_")
  with jax.profiler.trace(d, create_perfetto_trace=True):
    t0 = time.perf_counter()
    for _ in range(steps):
      o = fn()
    jax.block_until_ready(o)
    wall = (time.perf_counter() - t0) / steps
  ev = load_trace_events(d)
  dev = device_events(ev)
  per = collections.Counter()
  count = collections.Counter()
  for e in dev:
    per[e["name"]] += e.get("dur", 0) / steps
    count[e["name"]] += 1 / steps
  busy = busy_time([(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev]) / steps
  source_of = source_of or {}
  top = [dict(kernel=k[:120], us=round(v, 1), launches=round(count[k], 1),
              **({"source": short_source(source_of[k])} if k in source_of else {}))
         for k, v in per.most_common(FLAGS.top)]
  host = host_event_summary(ev, dev, steps)
  sources = time_by_source(per, count, source_of)
  phases = ({p: round(us / steps / 1e3, 4) for p, us in attribute_phases(dev, phase_of).items()}
            if phase_of and dev else None)
  if FLAGS.timeline and phase_of is not None:  # the dustin step
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    rows = timeline(dev, phase_of)
    with gzip.open(os.path.join(FLAGS.out_dir, FLAGS.out_name + ".timeline.json.gz"),
                   "wt") as f:
      json.dump(rows, f)
    plot_timeline(rows, os.path.join(FLAGS.out_dir, FLAGS.out_name + ".timeline.png"),
                  f"dustin step, {FLAGS.model}, {FLAGS.context} x {FLAGS.batch}, "
                  f"gamma {FLAGS.gamma}: {steps} steps")
  return dict(phase_ms=phases, graph=graph_mode(), step_ms=1e3 * step,
              profiled_wall_ms=1e3 * wall, gpu_busy_ms=busy / 1e3,
              kernel_sum_ms=sum(per.values()) / 1e3, launches=round(sum(count.values())),
              top=top, by_source=sources[:FLAGS.top], host=host[:FLAGS.top])


def host_event_summary(ev, dev, steps):
  """Host time per traced host event name per step (digits folded, so one
  line per kind of event: e.g. all kernel-launch thunks together); `dev`:
  the GPU kernel events, whose processes are not the host's."""
  gpu_pids = {e["pid"] for e in dev}
  per, count = collections.Counter(), collections.Counter()
  for e in ev:
    if e.get("ph") != "X" or e.get("pid") in gpu_pids:
      continue
    name = re.sub(r"\d+", "#", e["name"])[:100]
    per[name] += e.get("dur", 0) / steps
    count[name] += 1 / steps
  return [dict(event=k, us=round(v, 1), count=round(count[k], 1)) for k, v in per.most_common()]


def brief(measures: dict) -> dict:
  """A method's measures without the long kernel and host-event lists."""
  return {k: v for k, v in measures.items() if k not in ("top", "by_source", "host")}


def main(argv):
  del argv
  append_xla_flags(FLAGS.xla_flags)
  compile_cache_from_flag()
  thf, dhf = shapes.PAIRS[FLAGS.model]
  layers, b, ctx = None, FLAGS.batch, FLAGS.context
  if FLAGS.smoke:
    layers, b, ctx = 2, 2, 64
  mesh = sharding.make_mesh(1, FLAGS.mesh_model) if FLAGS.mesh_model > 1 else None
  dmesh = sharding.draft_mesh(mesh)
  tcfg = ModelConfig.from_hf(dict(thf), dtype="bfloat16", num_layers=layers)
  dcfg = ModelConfig.from_hf(dict(dhf), dtype="bfloat16", num_layers=layers)
  target, draft = random_model(tcfg, 0, mesh), random_model(dcfg, 1, dmesh)
  draft_mlp = resolve_draft_mlp(FLAGS.draft_mlp, dcfg, mesh)
  draft = draft.with_draft_mlp(draft_mlp).with_draft_head(FLAGS.draft_head)
  tcfg, dcfg = target.cfg, draft.cfg
  # lengths grow as steps commit: room for every step this script runs
  n_steps = 2 + steady_step_count(FLAGS.asrun_steps) + FLAGS.steps
  # whole tiles of rows (TMA kernels want a multiple of 8)
  max_len = round_up(ctx + (n_steps + 2) * (FLAGS.gamma + 1) + 8, 128)
  out = {"device": jax.devices()[0].device_kind, "devices": FLAGS.mesh_model,
         "model": FLAGS.model, "draft_mlp": draft_mlp,
         "draft_head": FLAGS.draft_head, "batch": b, "context": ctx, "gamma": FLAGS.gamma,
         "jax_version": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}

  vstep = bind_vanilla_step(target, mesh=mesh)
  box = {"v": VanillaState(random_cache(tcfg, b, max_len, ctx, 11, mesh=mesh),
                           fresh_decode_state(b, mesh))}
  def vrun():  # lengths grow by one per step from `ctx`
    box["v"], o = vstep(box["v"])
    return o.tokens
  if "vanilla" in FLAGS.methods:
    out["vanilla"] = profile(vrun, FLAGS.steps)
    print(json.dumps({"vanilla": brief(out["vanilla"])}), flush=True)

  policy = policy_from_config(dict(policy="dustin", budget=512, n_sink=16, n_window=64, m=128),
                              tcfg, dcfg)
  cfg = SpecConfig(gamma=FLAGS.gamma, policy=policy, draft_kv="streaming", mesh=mesh)
  dcache = random_cache(dcfg, b, max_len, ctx, 13, mesh=dmesh)
  st = {"s": spec_state_at(box.pop("v").cache, dcache, ctx, policy, mesh)}
  sstep = bind_spec_step(target, draft, cfg)
  hlo_text = sstep.lower(st["s"]).compile().as_text()
  phase_of, source_of = hlo_phases(hlo_text), hlo_op_names(hlo_text)
  if FLAGS.save_hlo:
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with gzip.open(os.path.join(FLAGS.out_dir, FLAGS.out_name + ".hlo.txt.gz"), "wt") as f:
      f.write(hlo_text)
  def srun():
    st["s"], o = sstep(st["s"])
    return o.tokens
  if "dustin" in FLAGS.methods:
    out["dustin"] = profile(srun, FLAGS.steps, phase_of, source_of)
    print(json.dumps({"dustin": brief(out["dustin"])}), flush=True)
  write_json(os.path.join(FLAGS.out_dir, FLAGS.out_name), out)
  for m in FLAGS.methods:
    print(f"\n{m}: step {out[m]['step_ms']:.2f} ms (steps queued), GPU busy "
          f"{out[m]['gpu_busy_ms']:.2f} ms, {out[m]['launches']} launches")
    if out[m]["phase_ms"]:
      print("  per phase (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in out[m]["phase_ms"].items())
            + ("  (concurrent graph: the phases overlap, see scripts.benchmarking.graph_mode)"
               if out[m]["graph"] == "concurrent" else ""))
    for t in out[m]["top"][:15]:
      print(f"  {t['us']:9.1f} us  x{t['launches']:<6} {t['kernel'][:60]}  "
            f"{t.get('source', '')[-110:]}")
    if out[m].get("by_source"):
      print("  by source:")
      for t in out[m]["by_source"][:15]:
        print(f"  {t['us']:9.1f} us  x{t['launches']:<6} {t['source'][:100]}")
    print("  host:")
    for t in out[m]["host"][:15]:
      print(f"  {t['us']:9.1f} us  x{t['count']:<6} {t['event'][:90]}")


if __name__ == "__main__":
  app.run(main)
