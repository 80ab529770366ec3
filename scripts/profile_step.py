r"""Where the time of one decoding step goes: device time per kernel.

  python -m scripts.profile_step --out_dir=results/h200 --context=32768 --batch=16

Runs the vanilla step and the dustin step (random weights of the Qwen2.5-7B /
0.5B shapes, caches filled to `context`) under the JAX profiler and sums the
GPU kernel time per kernel name: wall time per step, GPU busy time (the
union of kernel intervals), and the top kernels. Writes profile_step.json.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time

from absl import app
from absl import flags

from dustin_jax.benchmarking import busy_time, device_events, load_trace_events

flags.DEFINE_string("out_dir", "results/h200", "where profile_step.json goes")
flags.DEFINE_integer("context", 32768, "context length")
flags.DEFINE_integer("batch", 16, "batch size")
flags.DEFINE_integer("gamma", 4, "draft length")
flags.DEFINE_integer("steps", 3, "profiled steps per method")
flags.DEFINE_integer("top", 25, "kernels listed per method")
flags.DEFINE_bool("smoke", False, "tiny shapes (CPU)")
FLAGS = flags.FLAGS


def profile(fn, steps):
  """`fn()` runs one step and returns its output; steps are queued back to
  back (the host one step ahead, as the decode loops run) and waited for
  at the end."""
  import jax
  jax.block_until_ready(fn())  # compile + warm up
  jax.block_until_ready(fn())
  d = tempfile.mkdtemp(prefix="prof_step_")
  with jax.profiler.trace(d, create_perfetto_trace=True):
    t0 = time.perf_counter()
    for _ in range(steps):
      o = fn()
    jax.block_until_ready(o)
    wall = (time.perf_counter() - t0) / steps
  dev = device_events(load_trace_events(d))
  per = collections.Counter()
  count = collections.Counter()
  for e in dev:
    per[e["name"]] += e.get("dur", 0) / steps
    count[e["name"]] += 1 / steps
  busy = busy_time([(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev]) / steps
  top = [dict(kernel=k[:120], us=round(v, 1), launches=round(count[k], 1))
         for k, v in per.most_common(FLAGS.top)]
  return dict(wall_ms=1e3 * wall, gpu_busy_ms=busy / 1e3, kernel_sum_ms=sum(per.values()) / 1e3,
              launches=round(sum(count.values())), top=top)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from configs import shapes
  from dustin_jax.cache import random_cache
  from dustin_jax.config import ModelConfig
  from dustin_jax.generate import DecodeState, Model, bind_vanilla_step
  from dustin_jax.selection.policies import policy_from_config
  from dustin_jax.spec.step import SpecConfig, SpecState, bind_spec_step
  from dustin_jax.weights import random_params

  thf, dhf, layers = dict(shapes.QWEN25_7B), dict(shapes.QWEN25_05B), None
  b, ctx = FLAGS.batch, FLAGS.context
  if FLAGS.smoke:
    layers, b, ctx = 2, 2, 64
  tcfg = ModelConfig.from_hf(thf, dtype="bfloat16", num_layers=layers)
  dcfg = ModelConfig.from_hf(dhf, dtype="bfloat16", num_layers=layers)
  target, draft = Model(tcfg, *random_params(tcfg, 0)), Model(dcfg, *random_params(dcfg, 1))
  max_len = ctx + (FLAGS.steps + 2) * (FLAGS.gamma + 1) + 8  # lengths grow as steps commit
  full = jnp.full((b,), ctx, jnp.int32)
  ds0 = DecodeState.init([[1, 2]] * b, 1 << 30, jax.random.key(0))
  fresh = lambda: jax.tree_util.tree_map(lambda x: x.copy(), ds0)
  out = {"device": jax.devices()[0].device_kind, "batch": b, "context": ctx,
         "gamma": FLAGS.gamma, "jax_version": jax.__version__}

  vstep = bind_vanilla_step(target)
  box = {"c": random_cache(tcfg, b, max_len, ctx, 11), "ds": ds0}
  def vrun():  # lengths grow by one per step from `ctx`
    box["c"], box["ds"], o, _ = vstep(box["c"], box["ds"])
    return o
  out["vanilla"] = profile(vrun, FLAGS.steps)
  print(json.dumps({"vanilla": {k: v for k, v in out["vanilla"].items() if k != "top"}}), flush=True)

  policy = policy_from_config(dict(policy="dustin", budget=512, n_sink=16, n_window=64, m=128),
                              tcfg, dcfg)
  cfg = SpecConfig(gamma=FLAGS.gamma, policy=policy, draft_kv="streaming")
  c = box.pop("c")
  st = {"s": SpecState(c.with_lengths(full.copy()), random_cache(dcfg, b, max_len, ctx, 13),
                       fresh(), policy.init(b, max_len))}
  sstep = bind_spec_step(target, draft, cfg)
  def srun():
    st["s"], o = sstep(st["s"])
    return o.tokens
  out["dustin"] = profile(srun, FLAGS.steps)
  print(json.dumps({"dustin": {k: v for k, v in out["dustin"].items() if k != "top"}}), flush=True)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "profile_step.json"), "w") as f:
    json.dump(out, f, indent=1)
  for m in ("vanilla", "dustin"):
    print(f"\n{m}: wall {out[m]['wall_ms']:.2f} ms, GPU busy {out[m]['gpu_busy_ms']:.2f} ms, "
          f"{out[m]['launches']} launches")
    for t in out[m]["top"][:15]:
      print(f"  {t['us']:9.1f} us  x{t['launches']:<6} {t['kernel'][:90]}")


if __name__ == "__main__":
  app.run(main)
