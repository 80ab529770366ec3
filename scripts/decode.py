r"""Decode text (or random prompts) with speculative or plain decoding.

  python -m scripts.decode --config=configs/demo.py
  python -m scripts.decode --config=configs/tiny.py --config.gamma=2 \
      --config.selection.policy=dustin --config.output_json=/tmp/out.json

Prints the generated text of every sequence and a stats block (tokens/s,
mean accepted length tau, acceptance rate, and the wall clock a user waits:
load, prefill, compile, time to first token, decode);
`--config.output_json` writes the same as JSON with the token ids and text
of every sequence under `sequences`. (Device time per phase of the step:
`scripts/trace_step.py`.)

A problem with the config or the inputs (a bad value, a missing or
malformed file, a checkpoint that does not match, a prompt that does not
fit) is found before any weight is loaded where it can be, and is reported
as one `error: ...` line naming the input and the fix, with exit status 1.
"""

import contextlib
import json
import logging
import os
import sys
import tempfile
import time

import jax
from absl import app
from absl import flags
from ml_collections import config_flags

from dustin_jax import run as runlib
from dustin_jax.compilation import CompileClock, use_compile_cache
from dustin_jax.config import ConfigError, append_xla_flags
from dustin_jax.run import USER_ERRORS
from dustin_jax.speculative.engine import generate_speculative
from dustin_jax.vanilla import generate

_CONFIG = config_flags.DEFINE_config_file("config", None, "ml_collections run config file.",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def run(c) -> dict:
  t0 = time.perf_counter()
  with CompileClock() as clock:
    b = runlib.build(c)
  load_s = time.perf_counter() - t0
  common = dict(max_new_tokens=c.max_new_tokens, max_len=c.max_len, seed=c.seed,
                token_block=c.prefill_block, progress=c.progress)
  if c.method == "vanilla":
    seqs, stats = generate(b.target, b.prompts, sampling=b.spec.sampling, eos_ids=b.eos,
                           impl=c.impl, mesh=b.mesh, **common)
  else:
    seqs, stats = generate_speculative(b.target, b.draft, b.prompts, cfg=b.spec, **common)
  total_s = time.perf_counter() - t0
  wall = dict(load_s=load_s, prefill_s=stats.prefill_s, decode_s=stats.decode_s, total_s=total_s,
              compile_s=clock.seconds + stats.compile_s,
              time_to_first_token_s=load_s + stats.prefill_s + stats.first_step_s)
  return {
      "method": c.method, "policy": c.selection.policy if c.method == "speculative" else None,
      "gamma": c.gamma if c.method == "speculative" else None,
      "device": str(jax.devices()[0].device_kind), "mesh": dict(b.mesh.shape),
      "compile_cache": jax.config.jax_compilation_cache_dir or None,
      "memory_plan_bytes": {k: getattr(b.memory_plan, k) for k in
                            ("weights", "target_cache", "draft_cache", "workspace", "total")},
      "wall": wall, "stats": stats.as_dict(),
      "sequences": [{"tokens": s, "text": (b.tokenizer.decode(s, skip_special_tokens=True)
                                          if b.tokenizer else None)} for s in seqs],
  }


def print_result(r) -> None:
  for i, s in enumerate(r["sequences"]):
    print(f"\n=== sequence {i} ({len(s['tokens'])} tokens) ===")
    print(s["text"] if s["text"] is not None else s["tokens"])
  st, w = r["stats"], r["wall"]
  print("\n=== stats ===")
  spec = f"  policy {r['policy']}  gamma {r['gamma']}" if r["policy"] else ""
  print(f"method {r['method']}{spec}  device {r['device']}")
  print(f"wall {w['total_s']:.1f} s: load {w['load_s']:.1f} s, prefill {w['prefill_s']:.1f} s, "
        f"decode {w['decode_s']:.1f} s; of these compile {w['compile_s']:.1f} s "
        f"(compilation cache: {r['compile_cache'] or 'off'})")
  print(f"time to first token {w['time_to_first_token_s']:.1f} s  "
        f"prefill {st['prompt_tokens']} tokens, {st['prefill_tokens_per_s']:.0f} tokens/s")
  print(f"decode {st['tokens']} tokens in {st['steps']} steps, {st['tokens_per_s']:.2f} tokens/s "
        f"(compile excluded)  tau {st['tau']:.2f}  acceptance rate {st['acceptance_rate']:.2f}")


def check_output(path: str) -> None:
  """Create the directory of `path` and prove it writable, before any work:
  a run never ends with results it cannot write."""
  full = os.path.abspath(path)
  if os.path.isdir(full) or path.endswith(os.sep):
    raise ConfigError(f"output_json {path!r} is a directory: give a file name, e.g. "
                      f"{os.path.join(path, 'out.json')!r}")
  parent = os.path.dirname(full)
  existing = parent
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f"output_json {path!r}: {existing!r} is a file, not a directory: choose "
                      "another path")
  try:
    os.makedirs(parent, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=parent, prefix=".decode-probe-")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"output_json {path!r}: cannot write in {parent!r} ({e.strerror}): choose "
                      "a writable directory") from None


def write_json(path: str, obj) -> None:
  """Write `obj` to `path` atomically: a temporary file in the same
  directory, renamed over `path` once complete."""
  parent = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def _fail(msg: str) -> None:
  sys.exit("error: " + " ".join(str(msg).split("\n")))


def main(argv):
  del argv
  # JAX logs each backend it fails to find (no TPU here) at INFO: noise
  # beside a one-line error
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  c = _CONFIG.value
  append_xla_flags(c.xla_flags)  # nothing has started the backend yet
  if c.mem_fraction:
    if not 0 < c.mem_fraction <= 1:
      _fail(f"mem_fraction={c.mem_fraction} must be in (0, 1]")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(c.mem_fraction)
  try:
    if c.output_json:
      check_output(c.output_json)
    try:
      use_compile_cache(c.compile_cache)
    except OSError as e:
      _fail(f"compile_cache {c.compile_cache!r}: cannot use {e.filename!r} ({e.strerror}): "
            "give a writable directory, or --config.compile_cache='' to compile every run")
    r = run(c)
  except USER_ERRORS as e:
    _fail(e)
  print_result(r)
  if c.output_json:
    try:
      write_json(c.output_json, r)
    except OSError as e:
      _fail(f"cannot write output_json {c.output_json!r}: {e.strerror or e}")
    print(f"wrote {c.output_json}")


def _config_path(argv) -> str:
  """The --config file named in `argv` (without a `:arg`), read from argv
  itself: the flag holds no value when its file failed to load."""
  path = "?"
  for i, a in enumerate(argv):
    if a.startswith(("--config=", "-config=")):
      path = a.split("=", 1)[1]
    elif a in ("--config", "-config") and i + 1 < len(argv):
      path = argv[i + 1]
  return path.split(":", 1)[0]


def _config_file_problem(e: Exception, argv) -> str:
  """The one-line reason why the --config file could not be loaded."""
  path = _config_path(argv)
  if not os.path.exists(path):
    return f"--config file {path!r} does not exist"
  if os.path.isdir(path):
    return f"--config file {path!r} is a directory: give a config .py file"
  return f"--config file {path!r} cannot be loaded: {str(e).splitlines()[0]}"


def parse_flags(argv):
  """absl flag parsing, with each config problem (a missing or broken
  config file, an unknown key, a bad value, a stray argument) as one line
  instead of a traceback."""
  old = [a for a in argv if a.startswith("--config.dustin.")]
  if old:
    _fail(f"{old[0].split('=')[0]} is not a config key: the verification set's settings are "
          f"--config.selection.* (e.g. {old[0].replace('--config.dustin.', '--config.selection.')})")
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.get("method")  # a config file that failed to load raises here
  except SyntaxError as e:
    _fail(f"--config file {e.filename!r} line {e.lineno}: {e.msg}")
  except OSError as e:
    _fail(_config_file_problem(e, argv))
  except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as e:
    text = str(e)
    path = _config_path(argv)
    if path != "?" and not os.path.isfile(path):  # its overrides are unknown flags then
      _fail(_config_file_problem(e, argv))
    if "Error whilst parsing config file" in text:  # get_config() itself raised
      _fail(f"--config file {_config_path(argv)!r}: get_config() raised "
            f"{text.strip().splitlines()[-1]}")
    if "has no attribute 'get_config'" in text:
      _fail(f"--config file {_config_path(argv)!r} defines no get_config()")
    msg = text.strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
    if "--config=None" in msg:
      _fail("--config is required, e.g. --config=configs/tiny.py" if path == "?" else
            f"--config file {path!r}: get_config() returned nothing")
    _fail(f"bad --config override: {msg}")
  if len(rest) > 1:
    _fail(f"unexpected argument {rest[1]!r}: settings are flags, e.g. --config.prompt='...'")
  return rest


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
