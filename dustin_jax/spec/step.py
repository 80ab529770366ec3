"""The speculative step: draft -> select -> verify -> accept -> commit.

One pure function of `(target params, draft params, SpecState)`, jitted with
the state (both KV caches) donated. Everything data-dependent is an array;
gamma, batch, budget and max length are static, so the step never
recompiles and never waits on the host.

Cache invariants between steps (see generate.py): both caches hold the same
committed tokens, `lengths` equal; `pending` is in neither. The draft's first
forward re-feeds the last committed token together with `pending`: when the
previous step accepted every draft token, the draft never wrote the last
one's KV row, and re-writing an existing row is harmless. So speculative
decoding needs prompts of at least two tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dustin_jax.cache import KVCache
from dustin_jax.generate import BoundStep, DecodeState, Model, emit
from dustin_jax.sampling import SamplingConfig, pad_vocab, probs, sample
from dustin_jax.selection.base import FullCache, sink_window_indices
from dustin_jax.sharding import draft_mesh

DRAFT_KV_MODES = ("full", "streaming")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of the step (hashable: a jit static argument)."""
  gamma: int = 4
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()
  policy: Any = FullCache()
  draft_kv: str = "full"          # "streaming": MagicDec-style sink + window
  draft_sink: int = 16
  draft_window: int = 496
  impl: str = "auto"              # attention kernels: auto | reference | gpu | tpu
  mesh: Any = None                # a jax.sharding.Mesh: attention runs per device
                                  # (the draft whole on each: sharding.draft_mesh)

  def __post_init__(self):
    if self.gamma < 1:
      raise ValueError(f"gamma must be >= 1, got {self.gamma}")
    if self.draft_kv not in DRAFT_KV_MODES:
      raise ValueError(f"draft_kv must be one of {DRAFT_KV_MODES}, got {self.draft_kv!r}")
    if self.draft_kv == "streaming" and self.draft_sink + self.draft_window < 1:
      raise ValueError("a streaming draft cache needs draft_sink + draft_window >= 1")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
  target: KVCache
  draft: KVCache
  decode: DecodeState
  signals: Any   # the policy's carried signals


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  tokens: jax.Array      # int32[B, gamma+1], -1 where nothing was emitted
  n_emitted: jax.Array   # int32[B]
  n_accepted: jax.Array  # int32[B] draft tokens accepted (before stop cuts)
  active: jax.Array      # bool[B] sequence was unfinished at step start
  done: jax.Array        # bool[B] sequence is finished after this step
  kv_indices: Any        # the verification set used (None: full cache)


# ------------------------------------------------------------------ phases
def draft_phase(graphdef, params, cache: KVCache, ds: DecodeState, signals, cfg: SpecConfig):
  """gamma draft tokens, their draft distributions [B, gamma, V_d] and the
  policy's lookahead signal (its gamma queries scored in one call). The
  draft cache gets rows for prev, pending and d_1 .. d_{gamma-1}; its
  committed length is not moved."""
  model = nnx.merge(graphdef, params)
  policy = cfg.policy
  base = cache.lengths
  mesh = draft_mesh(cfg.mesh)

  def forward(c, tokens, at):
    """Run `tokens[B, n]`, the first at positions `at[b]`: logits of the last."""
    kv = (sink_window_indices(at, cfg.draft_sink, cfg.draft_window)
          if cfg.draft_kv == "streaming" else None)
    hidden, c, taps = model(tokens, c.with_lengths(at), kv_indices=kv,
                            tap_layers=policy.draft_tap_layers, impl=cfg.impl,
                            mesh=mesh)
    return model.logits(hidden[:, -1]), taps, c

  def pick(logits, key):
    q = probs(logits, cfg.sampling)
    tok = jnp.argmax(q, -1).astype(jnp.int32) if cfg.sampling.greedy else sample(key, q)
    return tok, q

  keys = jax.random.split(ds.rng, cfg.gamma + 1)
  logits, taps, cache = forward(cache, jnp.stack([ds.prev, ds.pending], 1), base - 1)
  # the lookahead queries are those that predict d_1 .. d_gamma: pending's first
  first_taps = {layer: q[:, 1:] for layer, q in taps.items()}
  tok, q = pick(logits, keys[1])

  def body(carry, xs):
    cache, tok = carry
    i, key = xs
    logits, taps, cache = forward(cache, tok[:, None], base + i)
    nxt, q = pick(logits, key)
    return (cache, nxt), (nxt, q, taps)

  # unrolled: on XLA:GPU a while loop waits on the host at every iteration
  (c, _), (toks, qs, scan_taps) = jax.lax.scan(
      body, (cache, tok), (jnp.arange(1, cfg.gamma), keys[2:]), unroll=max(cfg.gamma - 1, 1))
  drafts = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
  q_all = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  # the lookahead signal from all gamma queries at once, after drafting: every
  # key they attend to is written by now, and one scoring reads the SRH keys
  # once instead of gamma times
  lookahead = {layer: jnp.concatenate([q0, jnp.moveaxis(scan_taps[layer], 0, 1)[:, :, 0]], 1)
               for layer, q0 in first_taps.items()}
  signals = policy.observe_draft(signals, lookahead, c.with_lengths(base))
  rng = keys[0]
  return drafts, q_all, c.with_lengths(base), signals, rng


def verify_phase(graphdef, params, cache: KVCache, ds: DecodeState, drafts, kv_indices,
                 signals, cfg: SpecConfig):
  """The target over [pending, d_1 .. d_gamma] in one pass, attending to
  `kv_indices` (None: the full cache) plus the block. Returns target logits
  [B, gamma+1, V_t], the cache with the block written, updated signals."""
  model = nnx.merge(graphdef, params)
  block = jnp.concatenate([ds.pending[:, None], drafts], axis=1)
  hidden, cache, taps = model(block, cache, kv_indices=kv_indices,
                              tap_layers=cfg.policy.target_tap_layers, impl=cfg.impl,
                              mesh=cfg.mesh)
  signals = cfg.policy.observe_target(signals, taps, cache, cfg.gamma)
  return model.logits(hidden), cache, signals


def accept(target_logits, draft_probs, drafts, rng, sampling: SamplingConfig):
  """Leviathan/Chen acceptance. Returns (tokens[B, gamma+1] = accepted
  drafts then the correction or bonus token, n_accepted[B]).

  Greedy: a draft token is accepted iff it is the target's argmax. Sampling:
  accepted with probability min(1, p/q); at the first rejection the token is
  drawn from norm(max(p - q, 0)), after full acceptance from p."""
  b, gamma = drafts.shape
  vocab = max(target_logits.shape[-1], draft_probs.shape[-1])
  target_logits = pad_vocab(target_logits, vocab)
  if sampling.greedy:
    best = jnp.argmax(target_logits, -1).astype(jnp.int32)  # [B, gamma+1]
    ok = best[:, :gamma] == drafts
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    fix = jnp.take_along_axis(best, n_acc[:, None], axis=1)[:, 0]
  else:
    q = jnp.pad(draft_probs, ((0, 0), (0, 0), (0, vocab - draft_probs.shape[-1])))
    p = probs(target_logits, sampling)
    k_u, k_fix = jax.random.split(rng)
    p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    u = 1.0 - jax.random.uniform(k_u, (b, gamma))  # (0, 1]
    ok = u * q_d <= p_d
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 after the last draft
    q_at = jnp.take_along_axis(q_ext, n_acc[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(resid, -1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_at)
    fix = sample(k_fix, resid)
  pos = jnp.arange(gamma + 1)[None]
  padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
  tokens = jnp.where(pos < n_acc[:, None], padded, fix[:, None])
  return tokens.astype(jnp.int32), n_acc


def commit_phase(target: KVCache, draft: KVCache, ds: DecodeState, tokens, n_acc, signals,
                 cfg: SpecConfig):
  """Emit (EOS / max-new cut) and advance both caches by the emitted count;
  rows of rejected tokens stay behind `lengths` and are overwritten later."""
  active = ~ds.done
  ds, out, n = emit(ds, tokens, n_acc + 1, cfg.eos_ids)
  target = target.commit(n)
  draft = draft.with_lengths(target.lengths)
  return SpecState(target, draft, ds, signals), out, n, active


# -------------------------------------------------------------- the step
def spec_step_fn(target_graphdef, target_params, draft_graphdef, draft_params,
                 st: SpecState, cfg: SpecConfig):
  """Unjitted step (compose, shard or time it); `spec_step` is the jitted one."""
  ds = st.decode
  # 1. draft gamma tokens (+ the draft-lookahead signal)
  drafts, q, draft_cache, signals, rng = draft_phase(
      draft_graphdef, draft_params, st.draft, ds, st.signals, cfg)
  # (evaluation-only policies, the oracle: this step's own full-cache verify
  # queries, before selecting; costs a second target pass)
  if getattr(cfg.policy, "full_verify_tap_layers", ()):
    model = nnx.merge(target_graphdef, target_params)
    block = jnp.concatenate([ds.pending[:, None], drafts], axis=1)
    _, full, taps = model(block, st.target, tap_layers=cfg.policy.full_verify_tap_layers,
                          impl=cfg.impl, mesh=cfg.mesh)
    signals = cfg.policy.observe_full_verify(signals, taps, full, cfg.gamma)
  # 2. choose the verification set I_verify from the signals
  kv_indices = cfg.policy.select(signals, st.target, cfg.gamma)
  # 3. verify all gamma+1 positions at once (+ the target-historical signal)
  logits, target_cache, signals = verify_phase(
      target_graphdef, target_params, st.target, ds, drafts, kv_indices, signals, cfg)
  # 4. accept
  rng, key = jax.random.split(rng)
  tokens, n_acc = accept(logits, q, drafts, key, cfg.sampling)
  # 5. commit
  ds = dataclasses.replace(ds, rng=rng)
  new, out, n, active = commit_phase(target_cache, draft_cache, ds, tokens, n_acc, signals, cfg)
  return new, StepOutput(out, n, jnp.where(active, n_acc, 0), active, new.decode.done, kv_indices)


spec_step = jax.jit(spec_step_fn, static_argnames=("target_graphdef", "draft_graphdef", "cfg"),
                    donate_argnames=("st",))


def bind_spec_step(target: Model, draft: Model, cfg: SpecConfig) -> BoundStep:
  """`spec_step` for a decode loop: `step(st) -> (st, out)`, the state
  donated, with cheap dispatch and the output written in place (see
  `BoundStep`)."""
  return BoundStep(spec_step_fn, (target, draft), donate=(0,), outputs_from=1, cfg=cfg)
