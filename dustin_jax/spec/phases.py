"""Per-phase timing of the speculative step.

The real step is one fused program, which has no phase boundaries to time.
Here each phase is jitted on its own and timed on warm, compiled code with
`block_until_ready`; the phase sum is close to, and usually above, the fused
step time (fusion and overlap are lost at the boundaries).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax

from dustin_jax.spec.step import (SpecConfig, SpecState, accept, commit_phase, draft_phase,
                                  spec_step, verify_phase)

_STATIC = ("target_graphdef", "draft_graphdef", "cfg")


@functools.partial(jax.jit, static_argnames=("draft_graphdef", "cfg"))
def _draft(draft_graphdef, draft_params, st: SpecState, cfg: SpecConfig):
  return draft_phase(draft_graphdef, draft_params, st.draft, st.decode, st.signals, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _select(signals, target_cache, cfg: SpecConfig):
  return cfg.policy.select(signals, target_cache, cfg.gamma)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "cfg"))
def _verify(target_graphdef, target_params, st: SpecState, drafts, kv_indices, signals,
            cfg: SpecConfig):
  return verify_phase(target_graphdef, target_params, st.target, st.decode, drafts, kv_indices,
                      signals, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _accept_commit(st, target_cache, draft_cache, logits, q, drafts, signals, rng, cfg):
  tokens, n_acc = accept(logits, q, drafts, rng, cfg.sampling)
  ds = dataclasses.replace(st.decode, rng=rng)
  return commit_phase(st, target_cache, draft_cache, ds, tokens, n_acc, signals, cfg)


def _median_ms(fn, repeats):
  jax.block_until_ready(fn())  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  times.sort()
  return 1e3 * times[len(times) // 2]


def time_phases(target, draft, st: SpecState, cfg: SpecConfig, repeats: int = 5) -> dict:
  """{draft, select, verify, commit, step} in milliseconds (median) for
  state `st`, which is left untouched (nothing is donated here, except a
  copy for the fused step)."""
  tg, tp, dg, dp = target.graphdef, target.state, draft.graphdef, draft.state
  drafts, q, draft_cache, signals, rng = _draft(dg, dp, st, cfg)
  kv = _select(signals, st.target, cfg)
  logits, target_cache, signals2 = _verify(tg, tp, st, drafts, kv, signals, cfg)
  out = {
      "draft": _median_ms(lambda: _draft(dg, dp, st, cfg), repeats),
      "select": _median_ms(lambda: _select(signals, st.target, cfg), repeats),
      "verify": _median_ms(lambda: _verify(tg, tp, st, drafts, kv, signals, cfg), repeats),
      "commit": _median_ms(lambda: _accept_commit(st, target_cache, draft_cache, logits, q,
                                                  drafts, signals2, rng, cfg), repeats),
  }
  copy = lambda: jax.tree_util.tree_map(lambda x: x.copy() if hasattr(x, "copy") else x, st)
  def fused():
    return spec_step(tg, tp, dg, dp, copy(), cfg=cfg)
  out["step"] = _median_ms(fused, repeats) - _median_ms(copy, repeats)
  return out
