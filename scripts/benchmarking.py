"""Measurement helpers of the benchmark scripts (the library never imports
them): device time out of JAX profiler traces, per-phase device time of the
fused speculative step, random models and caches of real shapes, and each
step's bandwidth floor.

Wall-clock timing of a few-microsecond kernel measures the host; the GPU
kernel intervals in a profiler trace measure the device.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import flags

from dustin_jax.cache import KVCache, cache_shardings
from dustin_jax.compilation import use_compile_cache
from dustin_jax.config import ModelConfig
from dustin_jax.decoding import DecodeState, Model
from dustin_jax.sharding import device_capacity, int8_head_bytes, shard_batch_tree
from dustin_jax.speculative.step import SpecConfig, SpecState
from dustin_jax.weights import place_model, random_fill, random_params


# every script's compilation cache (one definition: scripts imported into one
# process share it)
flags.DEFINE_string("compile_cache", "auto", "persistent XLA compilation cache: 'auto' "
                    "(<cache root>/xla), a directory, or '' (off)")


def compile_cache_from_flag():
  """Turn on the compilation cache `--compile_cache` names (a re-run loads
  its programs instead of compiling them)."""
  return use_compile_cache(flags.FLAGS.compile_cache)


def load_trace_events(trace_dir: str) -> list:
  """Chrome-trace events of the perfetto trace `jax.profiler.trace` wrote."""
  path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[-1]
  with gzip.open(path) as f:
    tr = json.load(f)
  return tr["traceEvents"] if isinstance(tr, dict) else tr


def device_events(ev) -> list:
  """Kernel events of the GPU stream threads (not XLA's op/module summary lines)."""
  pname, tname = {}, {}
  for e in ev:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pname[e["pid"]] = e.get("args", {}).get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      tname[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  gpu = {p for p, n in pname.items() if "GPU" in n or "gpu" in n}
  dev = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu]
  streams = [e for e in dev
             if "stream" in tname.get((e["pid"], e.get("tid")), "").lower()]
  if streams:
    return streams
  skip = ("xla modules", "xla ops", "steps", "tensorflow ops", "source code", "launch stats")
  return [e for e in dev if not any(
      k in tname.get((e["pid"], e.get("tid")), "").lower() for k in skip)]


def busy_time(intervals) -> float:
  """Length of the union of (start, end) intervals."""
  iv = sorted(intervals)
  if not iv:
    return 0.0
  busy, s, e = 0.0, iv[0][0], iv[0][1]
  for a, b in iv[1:]:
    if a > e:
      busy, s, e = busy + e - s, a, b
    else:
      e = max(e, b)
  return busy + e - s


def parse_device_times(ev, labels, n_calls):
  """Per label: (union of GPU kernel intervals, first-to-last span), in ms
  per call, from Chrome-trace events; device events are attributed to the
  host annotation window they start in."""
  dev = device_events(ev)
  host = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in ev
          if e.get("ph") == "X" and e.get("name") in labels}
  res = []
  for lab, n in zip(labels, n_calls):
    if lab not in host or not dev:
      res.append((None, None))
      continue
    t0, t1 = host[lab]
    iv = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev if t0 <= e["ts"] <= t1]
    if not iv:
      res.append((None, None))
      continue
    span = max(b for _, b in iv) - min(a for a, _ in iv)
    res.append((busy_time(iv) / n / 1e3, span / n / 1e3))
  return res


class DeviceTimer:
  """GPU time of host windows, read from a profiler trace.

      with DeviceTimer() as t:
        with t.window("draft"):
          jax.block_until_ready(draft())
      t.ms("draft")  # [ms per window], or None without device events (CPU)

  A window's device time is the union of the kernel intervals that start
  inside it, so a window must block until its work is done. Wall-clock
  timing of a step also counts the host's dispatch; this does not."""

  def __init__(self):
    self._labels: list[str] = []
    self._dir = None
    self._ev = None

  def __enter__(self):
    self._dir = tempfile.mkdtemp(prefix="device_timer_")
    jax.profiler.start_trace(self._dir, create_perfetto_trace=True)
    return self

  def __exit__(self, *exc):
    jax.profiler.stop_trace()
    self._ev = load_trace_events(self._dir)
    shutil.rmtree(self._dir, ignore_errors=True)
    return False

  def window(self, name: str):
    label = f"{name}#{len(self._labels)}"
    self._labels.append(label)
    return jax.profiler.TraceAnnotation(label)

  def times(self, name: str, n_calls=None) -> list[tuple]:
    """(GPU ms, first-to-last kernel span ms) of each `name` window, per
    call of the window's `n_calls`; (None, None) without device events."""
    labels = [lab for lab in self._labels if lab.rsplit("#", 1)[0] == name]
    return parse_device_times(self._ev, labels, n_calls or [1] * len(labels))

  def ms(self, name: str) -> list[float] | None:
    if not device_events(self._ev):
      return None
    # a window that launched no kernel (e.g. the full cache's empty selection) took 0
    return [b or 0.0 for b, _ in self.times(name)]


def median_seconds(fn, warmup: int, repeats: int):
  """(median wall seconds of `repeats` calls of `fn()` after `warmup`
  untimed ones, each waited for; the last call's result)."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times, out = [], None
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def queued_steps(step, carry, n: int):
  """(carry, wall seconds, host seconds) of `n` calls `carry, out =
  step(carry)` queued back to back and waited for at the end, as a decode
  loop runs them; host seconds: until the last is queued."""
  t0 = time.perf_counter()
  out = None
  for _ in range(n):
    carry, out = step(carry)
  host = time.perf_counter() - t0
  jax.block_until_ready(out)
  return carry, time.perf_counter() - t0, host


STEADY_PAIRS = 3  # timed runs of each queue length in `steady_step_seconds`


def steady_step_count(n: int, pairs: int = STEADY_PAIRS) -> int:
  """How many steps `steady_step_seconds(..., n, pairs)` queues (callers
  size their caches for the rows those steps commit)."""
  return pairs * (n + 3 * n)


def steady_step_seconds(step, carry, n: int, pairs: int = STEADY_PAIRS):
  """(carry, {step, queued, host}: seconds per step) of `step` queued as a
  decode loop queues it. `step` is the slope between n and 3n queued steps:
  what each further step of a long decode adds. The wall time of a short
  queue also holds the first step's dispatch, before the device starts
  (`queued`: the n-step queue's mean). `host`: the host's time to queue one
  step (above `step`, the loop is bound by the host). Each queue length is
  timed `pairs` times and its fastest run kept: noise only adds time, and a
  slope of single runs can come out below zero when a step is short against
  the noise. Where even the fastest runs leave no positive slope (steps far
  shorter than the noise), `step` is `queued`, an upper bound, and
  `resolved` is False."""
  short, long, host = [], [], []
  for _ in range(pairs):
    carry, t, _ = queued_steps(step, carry, n)
    short.append(t)
    carry, t, h = queued_steps(step, carry, 3 * n)
    long.append(t)
    host.append(h)
  short, long = min(short), min(long)
  resolved = long > short
  return carry, dict(step=(long - short) / (2 * n) if resolved else short / n,
                     queued=short / n, host=min(host) / (3 * n), resolved=resolved)


def tau_draft_cache(record: dict) -> tuple:
  """The draft a tau record was measured with: its cache, ("full", None,
  None) or ("streaming", sink rows, recent rows), and its LM head ("native"
  or "int8"); records without the fields are a full-cache draft's with its
  native head."""
  return (record.get("draft_kv", "full"), record.get("draft_sink"), record.get("draft_window"),
          record.get("draft_head") or "native")


def write_json(path: str, obj) -> None:
  """`obj` as indented JSON at `path`, its directory made first; written
  beside it and renamed over it, so a killed run leaves the last whole file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1, default=str)
    f.write("\n")
  os.replace(path + ".tmp", path)


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (imported late: only
  the plotting needs it)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path: str, dpi: int = 120) -> None:
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)


def benchmark_pairs(smoke: bool) -> dict:
  """{name: (target hf dict, draft hf dict)}: the real shapes of
  `configs.shapes.PAIRS`, or with `smoke` one tiny pair (configs.tiny)."""
  if smoke:
    from configs import tiny  # (imports ml_collections, absent on the GPU machine)
    return {"tiny": (tiny.tiny_hf(3), tiny.tiny_hf(2))}
  from configs import shapes
  return shapes.PAIRS


def random_model(cfg, seed: int, mesh=None):
  """A Model with random weights of `cfg`'s shapes, made in their shards over
  `mesh` (KV heads replicated where the model axis needs it), laid out as
  the CLI decodes (`Model.with_folded_norms`)."""
  graphdef, state = random_params(cfg, seed=seed, mesh=mesh)
  if mesh is not None:
    cfg, graphdef, state = place_model(cfg, graphdef, state, mesh)
  return Model(cfg, graphdef, state).with_folded_norms()


def random_cache(cfg: ModelConfig, batch: int, max_len: int, context: int, seed: int,
                 mesh=None) -> KVCache:
  """A cache of random rows (`weights.random_fill`), committed up to
  `context`; made by one program, under `mesh` directly in its shards
  (`cache.cache_shardings`), never whole on one device."""
  shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  dt = jnp.dtype(cfg.dtype)
  def make():
    rows = lambda s: tuple(random_fill(shape, dt, "uniform", s + i) for i in range(cfg.num_layers))
    return KVCache(k=rows(seed), v=rows(seed + 7919),
                   lengths=jnp.full((batch,), context, jnp.int32))
  if mesh is None:
    return jax.jit(make)()
  return jax.jit(make, out_shardings=cache_shardings(cfg, mesh))()


def fresh_decode_state(batch: int, mesh=None):
  """A decode state far from its max_new (timed steps never finish),
  sharded over `mesh` like the decode loops shard it."""
  ds = DecodeState.init([[1, 2]] * batch, 1 << 30, jax.random.key(0))
  return ds if mesh is None else shard_batch_tree(ds, mesh)


def spec_state_at(tcache, dcache, context: int, policy, mesh=None):
  """A speculative decode state with both caches committed up to `context`,
  a fresh decode state and the policy's initial signals, sharded over
  `mesh` like the decode loops shard them."""
  b = tcache.batch
  full = jnp.full((b,), context, jnp.int32)
  signals = policy.init(b, tcache.max_len)
  if mesh is not None:
    full, signals = shard_batch_tree((full, signals), mesh)
  return SpecState(tcache.with_lengths(full), dcache.with_lengths(full.copy()),
                   fresh_decode_state(b, mesh), signals)


def floor_bytes(method, tcfg, dcfg, batch, context, gamma, budget, policy, ways=1,
                draft_rows=None, draft_head="native"):
  """The fewest HBM bytes one device must move in a step: weights once per
  forward, the KV rows each forward attends to, the SRH keys the estimation
  scores (once per step: the draft's gamma queries are scored in one call).
  The target's weights and KV are split `ways` ways (tensor parallel); the
  draft runs whole on every device. `draft_rows`: the streaming draft
  cache's sink + window rows (default SpecConfig's). `draft_head` "int8":
  the draft's LM head read as int8 rows and f32 row scales."""
  def weights(c):
    return c.num_params() * 2
  def draft_weights(c):
    if draft_head != "int8":
      return weights(c)
    return weights(c) - c.vocab_size * c.hidden_size * 2 + int8_head_bytes(c)
  def kv(c, rows):
    return c.kv_bytes_per_token(2) * rows * batch
  if method.startswith("vanilla"):
    return {"verify": (weights(tcfg) + kv(tcfg, context)) // ways}
  if draft_rows is None:
    draft_rows = SpecConfig().draft_sink + SpecConfig().draft_window
  draft_rows = context if method == "sd_full" else min(context, draft_rows)
  out = {"draft": gamma * (draft_weights(dcfg) + kv(dcfg, draft_rows))}
  rows = context if method.startswith("sd_") else budget
  out["verify"] = (weights(tcfg) + kv(tcfg, rows + gamma + 1)) // ways
  if policy is not None and hasattr(policy, "draft_heads"):
    k_row = 2 * batch * context  # bytes per head-dim column of one KV head's keys
    heads = {(l, h // dcfg.group_size) for l, h in policy.draft_heads}
    theads = {(l, h // tcfg.group_size) for l, h in policy.target_heads}
    out["estimate"] = k_row * (len(heads) * dcfg.head_dim + len(theads) * tcfg.head_dim)
  return out


# The floor's yardstick where it is not measured in the process: the
# bandwidth of a jnp copy, per device kind, as measured by
# scripts/bench_attention.py (results/h200/attention.json).
COPY_TBS = {"NVIDIA H200": 4.23}


def measure_copy_tbs(gib: float = 2.0, repeats: int = 3) -> float | None:
  """The device's copy bandwidth in TB/s: bytes read + written by one
  elementwise kernel over `gib` GiB of bf16 (a negation: XLA may run a bare
  copy as a memcpy, which is not a kernel) over its GPU time, the fastest
  of `repeats` calls after a warm-up; None where the trace has no device
  kernels (CPU)."""
  n = int(gib * 2**30) // 2
  x = jax.block_until_ready(jnp.ones((n,), jnp.bfloat16))
  copy = jax.jit(jnp.negative)
  jax.block_until_ready(copy(x))
  with DeviceTimer() as timer:
    for _ in range(repeats):
      with timer.window("copy"):
        jax.block_until_ready(copy(x))
  ms = timer.ms("copy")
  if not ms or not min(ms):
    return None
  return 2 * n * 2 / (min(ms) * 1e-3) / 1e12


def floor_time(rec: dict, copy_tbs: float | None = None) -> None:
  """Add `floor_ms` (a benchmark record's `floor_bytes` at the device's copy
  bandwidth: `copy_tbs` where measured in the process, else COPY_TBS's
  value for its device kind; `copy_tbs` and `copy_source` record which) and
  `floor_share` (floor_ms over the step's GPU time, else its time as run)."""
  tbs, source = copy_tbs, "measured"
  if tbs is None:
    tbs, source = COPY_TBS.get(rec.get("device")), "COPY_TBS"
  step = rec.get("gpu_ms") or rec.get("step_ms")
  if tbs and step and rec.get("floor_bytes"):
    rec["copy_tbs"], rec["copy_source"] = tbs, source
    rec["floor_ms"] = sum(rec["floor_bytes"].values()) / (tbs * 1e9)
    rec["floor_share"] = rec["floor_ms"] / step


# ----------------------------------------------------- phases of the fused step
# the step's named scopes (speculative/step.py); "estimate" sits inside
# "draft" and "verify" and wins: the innermost phase names a kernel's phase
PHASES = ("draft", "full_verify", "select", "verify", "accept", "commit", "estimate")


def _hlo_stack_frames(hlo_text: str) -> dict[int, str]:
  """Stack frame id -> "function file:line < caller file:line" from the
  stack-frame tables at the end of a compiled module's HLO text (the
  printer writes a frame's parent as parent id + 1, 0 for none)."""
  def table(name, pattern):
    i = hlo_text.find("\n" + name + "\n")
    if i < 0:
      return {}
    body = hlo_text[i + len(name) + 2:].split("\n\n")[0]
    return {int(m.group(1)): m.groups()[1:] for m in re.finditer(r"^(\d+) " + pattern, body, re.M)}
  files = {k: os.path.basename(v[0]) for k, v in table("FileNames", r'"([^"]*)"').items()}
  funcs = {k: v[0] for k, v in table("FunctionNames", r'"([^"]*)"').items()}
  locs = {k: f"{funcs.get(int(f), '?')} {files.get(int(n), '?')}:{line}" for k, (n, f, line) in
          table("FileLocations", r"\{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)").items()}
  frames = {k: (int(loc), int(parent) - 1) for k, (loc, parent) in
            table("StackFrames", r"\{file_location_id=(\d+) parent_frame_id=(\d+)").items()}
  out = {}
  for k, (loc, parent) in frames.items():
    chain = [locs.get(loc, "?")]
    if 0 < parent < k:
      chain.append(locs.get(frames[parent][0], "?"))
    out[k] = " < ".join(chain)
  return out


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """Kernel name -> the `op_name` metadata of its instruction in a compiled
  module's HLO text (the named scopes and JAX primitive it was traced from),
  followed by ` @ function file:line < caller file:line` where the
  instruction has a stack frame. GPU kernels of XLA fusions are named after
  their instruction with '.' and '-' as '_'."""
  frames = _hlo_stack_frames(hlo_text)
  out = {}
  for m in re.finditer(r"%([\w.-]+) = [^\n]*?op_name=\"([^\"]*)\"([^\n]*)", hlo_text):
    frame = re.search(r"stack_frame_id=(\d+)", m.group(3))
    where = frames.get(int(frame.group(1))) if frame else None
    out[re.sub(r"[.-]", "_", m.group(1))] = m.group(2) + (f" @ {where}" if where else "")
  return out


def hlo_phases(hlo_text: str) -> dict[str, str]:
  """Kernel name -> phase: the innermost of the step's named scopes in its
  instruction's `op_name` (`hlo_op_names`)."""
  out = {}
  for kernel, op_name in hlo_op_names(hlo_text).items():
    parts = op_name.split(" @ ")[0].split("/")
    phase = next((p for p in reversed(parts) if p in PHASES), None)
    if phase is not None:
      out[kernel] = phase
  return out


def timeline(dev, phase_of) -> list:
  """[start us, duration us, stream, kernel, phase] of the kernel events
  `dev`, in start order, times from the first kernel."""
  dev = sorted(dev, key=lambda e: e["ts"])
  t0 = dev[0]["ts"] if dev else 0
  return [[round(e["ts"] - t0, 2), round(e.get("dur", 0), 2), e.get("tid"), e["name"],
           (phase_of or {}).get(e["name"])] for e in dev]


PHASE_COLORS = {"draft": "tab:blue", "estimate": "tab:orange", "select": "tab:red",
                "verify": "tab:green", "accept": "tab:purple", "commit": "tab:brown"}
# Pallas kernels that only one phase calls (a kernel's name carries no scope)
PALLAS_PHASE = {"srh_logits": "estimate", "srh_scores": "estimate", "topk": "select",
                "topk_chunks": "select", "listed_attention": "verify"}


def row_phases(rows) -> list:
  """The phase of each `timeline` row: its own, else (a kernel that is no
  XLA instruction, e.g. a Pallas kernel) the one `PALLAS_PHASE` gives it,
  else that of the kernel before it on its stream, else that of the kernel
  started before it."""
  last, phase, out = {}, "draft", []
  for _, _, tid, name, p in rows:
    phase = p or PALLAS_PHASE.get(name.split("__")[0]) or last.get(tid, phase)
    last[tid] = phase
    out.append(phase)
  return out


def plot_timeline(rows, path, title=""):
  """One bar per kernel of `timeline` rows, a lane per stream, coloured by
  its phase (`row_phases`)."""
  fig, ax = pyplot().subplots(figsize=(16, 4.5))
  lanes = {tid: i for i, tid in enumerate(sorted({r[2] for r in rows}, key=str))}
  for (start, dur, tid, _, _), phase in zip(rows, row_phases(rows)):
    ax.broken_barh([(start / 1e3, max(dur, 0.5) / 1e3)], (lanes[tid] - 0.4, 0.8),
                   color=PHASE_COLORS.get(phase, "gray"), linewidth=0)
  ax.set_yticks(range(len(lanes)), [str(t) for t in lanes], fontsize=6)
  ax.set_xlabel("ms from the first kernel (profiled steps: the profiler stretches the gaps)")
  ax.set_ylabel("GPU stream")
  ax.legend(handles=[pyplot().Rectangle((0, 0), 1, 1, color=c, label=p)
                     for p, c in PHASE_COLORS.items()], loc="upper right", fontsize=8)
  ax.set_title(title or "kernels of the dustin step by stream and phase")
  save_figure(fig, path)


def graph_mode() -> str:
  """"concurrent" where XLA records the step's CUDA graph with concurrent
  commands (`dustin_jax.config.GRAPH_FLAGS`), else "serial". In a
  concurrent graph kernels of neighbouring phases overlap, so per-phase
  sums exceed the busy time and `attribute_phases` may give a Pallas kernel
  missing from `PALLAS_PHASE` a neighbouring phase: for a phase breakdown,
  run with --xla_flags=--xla_gpu_command_buffer_scheduling_mode=SERIALIZE."""
  flags = os.environ.get("XLA_FLAGS", "")
  return "concurrent" if "command_buffer_scheduling_mode=CONCURRENT" in flags else "serial"


def attribute_phases(events, phase_of: dict[str, str]) -> dict[str, float]:
  """Device microseconds per phase of GPU kernel `events` (one or more
  whole steps), each kernel's phase by `row_phases`: a kernel that is not
  an XLA instruction takes the phase `PALLAS_PHASE` names, else that of the
  kernel before it on its stream. In a concurrent graph neighbouring phases
  overlap, so the sums may exceed the busy time (`graph_mode`)."""
  rows = timeline(events, phase_of)
  total = collections.Counter()
  for row, phase in zip(rows, row_phases(rows)):
    total[phase] += row[1]
  return dict(total)


def phase_device_ms(step, state, steps: int, reset=lambda s: s):
  """Per-phase GPU time (ms per step) of the fused, bound speculative step,
  from one profiler trace of `steps` steps; None without device events
  (CPU). `reset(state)` prepares each next step; returns (ms, state)."""
  phase_of = hlo_phases(step.lower(state).compile().as_text())
  state = reset(step(state)[0])
  jax.block_until_ready(state)
  d = tempfile.mkdtemp(prefix="phases_")
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(steps):
      state = reset(step(state)[0])
    jax.block_until_ready(state)
  dev = device_events(load_trace_events(d))
  if not dev:
    return None, state
  return {p: us / steps / 1e3 for p, us in attribute_phases(dev, phase_of).items()}, state


def partial_products(x, w, parts: int):
  """`x [M, K] @ w [K, N]` as f32 [parts, M, N]: part p the product of the
  input slice [p K / parts, (p + 1) K / parts), one batched GEMM. At a few
  rows XLA splits a GEMM's input dimension itself and sums the partials in
  a separate kernel; this is the product a consumer that sums the partials
  itself would read."""
  k = x.shape[-1]
  xs = x.reshape(*x.shape[:-1], parts, k // parts)
  return jnp.einsum("...pk,pkn->p...n", xs, w.reshape(parts, k // parts, w.shape[-1]),
                    preferred_element_type=jnp.float32)


def capacity_bytes():
  """Memory one configuration may use: the first device's (GPU/TPU) or the
  host's available memory (CPU)."""
  device = device_capacity()
  if device:
    return device
  with open("/proc/meminfo") as f:
    info = dict(line.split(":", 1) for line in f)
  return int(info["MemAvailable"].split()[0]) * 1024


def time_by_source(per: dict, count: dict, source_of: dict) -> list[dict]:
  """GPU us and launches per step summed by the code a kernel comes from:
  the function chain of its `op_name` (`hlo_op_names`: "RMSNorm.__call__ <
  Block.finish"), else its kernel name (a Pallas kernel); largest first."""
  us, n = collections.Counter(), collections.Counter()
  for kernel, t in per.items():
    where = source_of.get(kernel, "").partition(" @ ")[2]
    key = " < ".join(f.split(" ")[0] for f in where.split(" < ")) if where else kernel
    us[key] += t
    n[key] += count[kernel]
  return [dict(source=k, us=round(v, 1), launches=round(n[k], 1)) for k, v in us.most_common()]


def short_source(op_name: str) -> str:
  """The last scopes of a kernel's `op_name` (`hlo_op_names`): the JAX
  primitive and the code around it, without the enclosing jits."""
  path, _, where = op_name.partition(" @ ")
  parts = [p for p in path.split("/") if not p.startswith("jit(")]
  return "/".join(parts[-4:]) + (f" @ {where}" if where else "")
