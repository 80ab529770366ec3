"""Per-phase timing of the speculative step.

The real step is one fused program, which has no phase boundaries to time.
Here each phase is jitted on its own (caches donated, as in the fused step,
so no KV cache is ever copied) and the phases run in sequence, each timed
with `block_until_ready`. Their sum is close to, and usually above, the
fused step time: fusion and overlap are lost at the boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax

from dustin_jax.benchmarking import DeviceTimer, median
from dustin_jax.spec.step import (SpecConfig, SpecState, accept, commit_phase, draft_phase,
                                  verify_phase)

PHASES = ("draft", "select", "verify", "commit")


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("cache",))
def _draft(graphdef, params, cache, ds, signals, cfg: SpecConfig):
  return draft_phase(graphdef, params, cache, ds, signals, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _select(signals, target_cache, cfg: SpecConfig):
  return cfg.policy.select(signals, target_cache, cfg.gamma)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("cache",))
def _verify(graphdef, params, cache, ds, drafts, kv_indices, signals, cfg: SpecConfig):
  return verify_phase(graphdef, params, cache, ds, drafts, kv_indices, signals, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("target", "draft"))
def _commit(target, draft, ds, logits, q, drafts, signals, rng, cfg: SpecConfig):
  tokens, n_acc = accept(logits, q, drafts, rng, cfg.sampling)
  return commit_phase(target, draft, dataclasses.replace(ds, rng=rng), tokens, n_acc, signals,
                      cfg)


def one_step_timed(target, draft, st: SpecState, cfg: SpecConfig, timer=None):
  """Run one step phase by phase. Returns (new state, {phase: wall seconds});
  with a `DeviceTimer`, each phase is also a window of it."""
  ds, t = st.decode, {}
  def clock(name, fn):
    window = timer.window(name) if timer is not None else contextlib.nullcontext()
    with window:
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn())
      t[name] = time.perf_counter() - t0
    return out
  drafts, q, dcache, signals, rng = clock("draft", lambda: _draft(
      draft.graphdef, draft.state, st.draft, ds, st.signals, cfg))
  kv = clock("select", lambda: _select(signals, st.target, cfg))
  logits, tcache, signals = clock("verify", lambda: _verify(
      target.graphdef, target.state, st.target, ds, drafts, kv, signals, cfg))
  rng, key = jax.random.split(rng)
  new, *_ = clock("commit", lambda: _commit(tcache, dcache, ds, logits, q, drafts, signals, key,
                                            cfg))
  return new, t


def time_phases_donated(target, draft, st: SpecState, cfg: SpecConfig, repeats: int = 5,
                        reset=lambda s: s):
  """Per-phase times over `repeats` steps after two warm-up steps: returns
  ({phase: median wall ms}, {phase: median device ms} or None where the
  profiler sees no device (CPU), last state). Wall times include each
  phase's dispatch from the host; device times are GPU kernel time only.
  `st` is consumed; `reset(new_state)` prepares the next step (benchmarks
  reset the lengths so that every step runs at the same context)."""
  for _ in range(2):
    st, _ = one_step_timed(target, draft, st, cfg)
    st = reset(st)
  samples = {p: [] for p in PHASES}
  with DeviceTimer() as timer:
    for _ in range(repeats):
      st, t = one_step_timed(target, draft, st, cfg, timer)
      st = reset(st)
      for p in PHASES:
        samples[p].append(t[p])
  wall = {p: 1e3 * median(v) for p, v in samples.items()}
  dev = {p: timer.ms(p) for p in PHASES}
  dev = None if any(v is None for v in dev.values()) else {p: median(v) for p, v in dev.items()}
  return wall, dev, st


@functools.partial(jax.jit, static_argnames=("cfg", "draft_heads", "target_heads"))
def _estimate(signals, draft_cache, target_cache, key, cfg: SpecConfig, draft_heads, target_heads):
  """The method's estimation alone: the lookahead scoring of gamma queries on
  the draft's SRH layers, the historical scoring of gamma + 1 on the
  target's, and the selection, on random queries of the right shapes."""
  policy, b = cfg.policy, target_cache.batch
  keys = jax.random.split(key, len(policy.draft_tap_layers) + len(policy.target_tap_layers) + 1)
  def taps(layers, t, heads, ks):
    return {l: jax.random.normal(k, (b, t, heads, target_cache.k[0].shape[-1]
                                     if heads == target_heads else draft_cache.k[0].shape[-1]),
                                 target_cache.k[0].dtype) for l, k in zip(layers, ks)}
  nd = len(policy.draft_tap_layers)
  t = taps(policy.draft_tap_layers, cfg.gamma, draft_heads, keys[:nd])
  signals = policy.observe_draft(signals, t, draft_cache)
  t = taps(policy.target_tap_layers, cfg.gamma + 1, target_heads, keys[nd:-1])
  signals = policy.observe_target(signals, t, target_cache, cfg.gamma)
  return policy.select(signals, target_cache, cfg.gamma), signals


def estimation_ms(target, draft, st: SpecState, cfg: SpecConfig, repeats: int = 5):
  """Median (wall ms, device ms or None) of the estimation alone (see
  `_estimate`); nothing donated."""
  key = jax.random.key(0)
  fn = lambda: _estimate(st.signals, st.draft, st.target, key, cfg, draft.cfg.num_heads,
                         target.cfg.num_heads)
  jax.block_until_ready(fn())
  jax.block_until_ready(fn())
  times = []
  with DeviceTimer() as timer:
    for _ in range(repeats):
      with timer.window("estimate"):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
  dev = timer.ms("estimate")
  return 1e3 * median(times), (median(dev) if dev else None)
