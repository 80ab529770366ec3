r"""Decode text (or random prompts) with speculative or plain decoding.

  python -m scripts.decode --config=configs/demo.py
  python -m scripts.decode --config=configs/tiny.py --config.gamma=2 \
      --config.dustin.policy=dustin --config.output_json=/tmp/out.json

Prints the generated text of every sequence and a stats block (tokens/s,
mean accepted length tau, acceptance rate, time per phase);
`--config.output_json` writes the same as JSON with the token ids and text of
every sequence under `sequences`.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections run config file.",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def run(c) -> dict:
  import jax
  from dustin_jax import run as runlib
  from dustin_jax.generate import generate
  from dustin_jax.spec.engine import generate_speculative, init_state
  from dustin_jax.spec.phases import time_phases_donated

  t0 = time.perf_counter()
  b = runlib.build(c)
  load_s = time.perf_counter() - t0
  target, draft, tok, spec = b["target"], b["draft"], b["tokenizer"], b["spec"]
  common = dict(max_new_tokens=c.max_new_tokens, max_len=c.max_len, seed=c.seed,
                chunk=c.prefill_chunk, progress=c.progress)
  if c.method == "vanilla":
    seqs, stats = generate(target, b["prompts"], sampling=spec.sampling, eos_ids=b["eos"],
                           impl=c.impl, mesh=b["mesh"], **common)
  else:
    seqs, stats = generate_speculative(target, draft, b["prompts"], cfg=spec, **common)
  phases = None
  if c.time_phases and c.method == "speculative":
    st = init_state(target, draft, b["prompts"], cfg=spec, max_new_tokens=c.max_new_tokens,
                    max_len=c.max_len, seed=c.seed, chunk=c.prefill_chunk)
    wall, device, _ = time_phases_donated(target, draft, st, spec, repeats=3)
    phases = device or wall  # GPU kernel time where the profiler sees a device
  result = {
      "method": c.method, "policy": c.dustin.policy if c.method == "speculative" else None,
      "gamma": c.gamma if c.method == "speculative" else None,
      "device": str(jax.devices()[0].device_kind), "load_s": load_s,
      "mesh": dict(b["mesh"].shape),
      "memory_plan_bytes": {k: getattr(b["memory_plan"], k) for k in
                            ("weights", "target_cache", "draft_cache", "workspace", "total")},
      "stats": stats.as_dict(), "phase_ms": phases,
      "sequences": [{"tokens": s, "text": tok.decode(s, skip_special_tokens=True) if tok else None}
                    for s in seqs],
  }
  return result


def print_result(r) -> None:
  for i, s in enumerate(r["sequences"]):
    print(f"\n=== sequence {i} ({len(s['tokens'])} tokens) ===")
    print(s["text"] if s["text"] is not None else s["tokens"])
  st = r["stats"]
  print("\n=== stats ===")
  spec = f"  policy {r['policy']}  gamma {r['gamma']}" if r["policy"] else ""
  print(f"method {r['method']}{spec}  device {r['device']}")
  print(f"tokens {st['tokens']}  steps {st['steps']}  decode {st['decode_s']:.2f} s  "
        f"prefill {st['prefill_s']:.2f} s  load {r['load_s']:.1f} s")
  print(f"tokens/s {st['tokens_per_s']:.2f}  tau {st['tau']:.2f}  "
        f"acceptance rate {st['acceptance_rate']:.2f}")
  if r["phase_ms"]:
    print("time per phase (ms): " + "  ".join(f"{k} {v:.1f}" for k, v in r["phase_ms"].items()))


def main(argv):
  del argv
  from dustin_jax.config import ConfigError, append_xla_flags
  from dustin_jax.generate import InputError
  c = _CONFIG.value
  append_xla_flags(c.xla_flags)  # nothing has started the backend yet
  if c.mem_fraction:
    if not 0 < c.mem_fraction <= 1:
      sys.exit(f"error: mem_fraction={c.mem_fraction} must be in (0, 1]")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(c.mem_fraction)
  try:
    r = run(c)
  except (ConfigError, InputError, ValueError) as e:
    sys.exit(f"error: {e}")
  print_result(r)
  if c.output_json:
    with open(c.output_json, "w") as f:
      json.dump(r, f, indent=1)
    print(f"wrote {c.output_json}")


def parse_flags(argv):
  """absl flag parsing, with config errors (unknown key, bad value) as one
  line instead of a traceback."""
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    msg = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
    sys.exit(f"error: bad --config override: {msg}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
