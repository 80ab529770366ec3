"""Attention Recovery Rate (ARR, METHOD.md §4 [ours]) and the evaluation step.

ARR of a verification set I at one verify step: for every layer, query head
and verify query of the target, take its FULL-cache attention probabilities,
keep the committed-context part (`p < lengths[b]`), renormalise it to sum to
1, and count the share that falls on I; average over queries, heads and
layers (per sequence). Choices:

* the new block is left out of both numerator and denominator: every verify
  set attends to it, so counting it would only inflate every policy alike;
  full verification (or a budget >= context) has ARR exactly 1;
* sink and window rows are part of I (they are attended), so they count;
* the reference attention is the target's full-cache pass over the block
  (its own queries at every layer), not the sparse pass: ARR asks how much of
  the attention the real model would pay is recovered;
* the probabilities come from `kernels.srh_scores` (one head, one query per
  call, vmapped): no second attention implementation
  (`signals.attention_weights`).

ARR is linear in I (a sum of per-row weights), so the Oracle policy's top-K
of those weights is the highest ARR any K-row set can reach.

`arr_step` is the speculative step with the measurement added: one extra
full-cache target pass over the block (all layers tapped) before selection,
then either `verify="full"` -- the target verifies with the full cache, so
the trajectory is the lossless one and every policy is measured on the same
states (offline profiling, Algorithm 1) -- or `verify="sparse"`, the
policy's own sparse verification (the deployed trajectory). It is also the
step in which the Oracle policy runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dustin_jax.cache import KVCache
from dustin_jax.generate import DecodeStats, Model, collect
from dustin_jax.selection.signals import attention_weights
from dustin_jax.spec.step import (SpecConfig, SpecState, StepOutput, accept, commit_phase,
                                  draft_phase, verify_phase)

VERIFY_MODES = ("full", "sparse")


def layer_weights(taps, cache: KVCache, *, impl: str = "auto") -> jax.Array:
  """f32[B, L, S]: per tapped layer (ascending), the mean over query heads
  and verify queries of the context-renormalised full attention (each row
  sums to 1 over the committed context). `cache` holds the block at
  `lengths[b] ..` (as after the verify forward, before commit)."""
  return jnp.stack([attention_weights(taps[l], cache.k[l], cache.lengths, impl=impl)
                    for l in sorted(taps)], axis=1)


def arr_of_indices(weights: jax.Array, kv_indices: jax.Array | None, lengths: jax.Array):
  """(arr f32[B], per-layer arr f32[B, L]) of the verification set
  `kv_indices[B, K]` (-1 padding, duplicate free; None: the full cache)
  under `weights[B, L, S]` from `layer_weights`."""
  b, n_layers, _ = weights.shape
  if kv_indices is None:
    per_layer = jnp.ones((b, n_layers), jnp.float32)
  else:
    idx = kv_indices.astype(jnp.int32)
    ok = (idx >= 0) & (idx < lengths.astype(jnp.int32)[:, None])
    got = jnp.take_along_axis(weights, jnp.where(ok, idx, 0)[:, None, :], axis=2)  # [B, L, K]
    per_layer = jnp.sum(jnp.where(ok[:, None, :], got, 0.0), axis=2)
  return jnp.mean(per_layer, axis=1), per_layer


def arr_of_step(target: Model, cache: KVCache, block: jax.Array, kv_indices, *,
                impl: str = "auto"):
  """ARR of `kv_indices` for one verify block, from outside a step: runs the
  target over `block[B, gamma+1]` with the full `cache` (pre-commit lengths)
  and measures. Returns (arr f32[B], per-layer f32[B, L])."""
  model = nnx.merge(target.graphdef, target.state)
  _, full, taps = model(block, cache, tap_layers=tuple(range(target.cfg.num_layers)), impl=impl)
  return arr_of_indices(layer_weights(taps, full, impl=impl), kv_indices, cache.lengths)


def oracle_indices(target: Model, cache: KVCache, block: jax.Array, budget: int, *,
                   impl: str = "auto") -> jax.Array:
  """int32[B, budget]: the Oracle's verification set for `block[B, gamma+1]`
  verified against `cache` (pre-commit lengths), from outside a step."""
  from dustin_jax.selection.policies import Oracle
  oracle = Oracle(budget=budget, num_layers=target.cfg.num_layers, impl=impl)
  model = nnx.merge(target.graphdef, target.state)
  _, full, taps = model(block, cache, tap_layers=oracle.full_verify_tap_layers, impl=impl)
  signals = oracle.observe_full_verify(oracle.init(cache.batch, cache.max_len), taps, full,
                                       block.shape[1] - 1)
  return oracle.select(signals, cache, block.shape[1] - 1)


def arr_step_fn(target_graphdef, target_params, draft_graphdef, draft_params, st: SpecState,
                cfg: SpecConfig, verify: str = "full"):
  """The speculative step with ARR measured. Returns (state, StepOutput,
  arr f32[B], per-layer arr f32[B, L])."""
  if verify not in VERIFY_MODES:
    raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
  ds, policy = st.decode, cfg.policy
  drafts, q, draft_cache, signals, rng = draft_phase(
      draft_graphdef, draft_params, st.draft, ds, st.signals, cfg)
  model = nnx.merge(target_graphdef, target_params)
  block = jnp.concatenate([ds.pending[:, None], drafts], axis=1)
  all_layers = tuple(range(model.cfg.num_layers))
  hidden, full_cache, taps = model(block, st.target, tap_layers=all_layers, impl=cfg.impl)
  weights = layer_weights(taps, full_cache, impl=cfg.impl)
  if hasattr(policy, "observe_full_verify"):
    signals = policy.observe_full_verify(signals, taps, full_cache, cfg.gamma)
  kv_indices = policy.select(signals, st.target, cfg.gamma)
  arr, per_layer = arr_of_indices(weights, kv_indices, st.target.lengths)
  if verify == "full":
    logits, target_cache = model.logits(hidden), full_cache
    signals = policy.observe_target(signals, {l: taps[l] for l in policy.target_tap_layers},
                                    full_cache, cfg.gamma)
  else:
    logits, target_cache, signals = verify_phase(
        target_graphdef, target_params, st.target, ds, drafts, kv_indices, signals, cfg)
  rng, key = jax.random.split(rng)
  tokens, n_acc = accept(logits, q, drafts, key, cfg.sampling)
  ds = dataclasses.replace(ds, rng=rng)
  new, out, n, active = commit_phase(target_cache, draft_cache, ds, tokens, n_acc,
                                     signals, cfg)
  return (new, StepOutput(out, n, jnp.where(active, n_acc, 0), active, new.decode.done,
                         kv_indices),
          arr, per_layer)


arr_step = jax.jit(arr_step_fn, static_argnames=("target_graphdef", "draft_graphdef", "cfg",
                                                 "verify"),
                   donate_argnames=("st",))


@dataclasses.dataclass
class ARRResult:
  mean: float = 0.0                 # over (sequence, step) pairs of active sequences
  per_layer: list = dataclasses.field(default_factory=list)
  per_step: list = dataclasses.field(default_factory=list)   # mean over active sequences
  seq_steps: int = 0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def evaluate_arr(target: Model, draft: Model, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, max_len: int, cfg: SpecConfig = SpecConfig(),
                 verify: str = "full", seed: int = 0, chunk: int = 256):
  """Speculative decoding with `arr_step`; returns (token lists, DecodeStats,
  ARRResult). With `verify="full"` and greedy sampling the tokens are those
  of full-cache speculative decoding whatever the policy."""
  from dustin_jax.spec.engine import init_state
  stats = DecodeStats(gamma=cfg.gamma)
  t0 = time.perf_counter()
  st = init_state(target, draft, prompts, max_new_tokens=max_new_tokens, max_len=max_len,
                  cfg=cfg, seed=seed, chunk=chunk)
  jax.block_until_ready(st)
  stats.prefill_s = time.perf_counter() - t0
  outs, res = [], ARRResult()
  tot, tot_layers = 0.0, 0.0
  t0 = time.perf_counter()
  while True:
    st, out, arr, per_layer = arr_step(target.graphdef, target.state, draft.graphdef,
                                       draft.state, st, cfg=cfg, verify=verify)
    tokens, n, n_acc, active, arr, per_layer = jax.device_get(
        (out.tokens, out.n_emitted, out.n_accepted, out.active, arr, per_layer))
    outs.append(tokens)
    stats.record(n, active, n_acc)
    if active.any():
      tot += float(arr[active].sum())
      tot_layers = tot_layers + per_layer[active].sum(axis=0)
      res.seq_steps += int(active.sum())
      res.per_step.append(float(arr[active].mean()))
    if bool(np.all(jax.device_get(st.decode.done))):
      break
  stats.decode_s = time.perf_counter() - t0
  if res.seq_steps:
    res.mean = tot / res.seq_steps
    res.per_layer = [float(x) for x in np.asarray(tot_layers) / res.seq_steps]
  return collect(outs), stats, res
