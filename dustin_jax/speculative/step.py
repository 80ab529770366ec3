"""The speculative step: draft -> select -> verify -> accept -> commit.

One pure function of `(target params, draft params, SpecState)`, jitted with
the state (both KV caches) donated. Everything data-dependent is an array;
gamma, batch, budget and max length are static, so the step never
recompiles and never waits on the host. `spec_step_fn` is the only place
the five phases are composed; what evaluation and profiling need on top
(ARR, the oracle's full-cache pass, lossless trajectories, teacher forcing)
are `StepOptions` of that same function. Each phase runs under a
`jax.named_scope` of its name, so a profiler trace of the fused step
attributes device time to phases.

Cache invariants between steps (see `decoding`): both caches hold the same
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
from jax.sharding import Mesh

from dustin_jax.bound_step import BoundStep
from dustin_jax.cache import KVCache
from dustin_jax.decoding import DecodeState, Model, StepOutput, emit
from dustin_jax.sampling import SamplingConfig, next_tokens, pad_vocab, probs, sample
from dustin_jax.selection.arr import arr_of_indices, layer_weights
from dustin_jax.selection.base import FullCache, Policy
from dustin_jax.sharding import draft_mesh

DRAFT_KV_MODES = ("full", "streaming")
VERIFY_MODES = ("sparse", "full")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of the step (hashable: a jit static argument)."""
  gamma: int = 4
  sampling: SamplingConfig = SamplingConfig()
  eos_ids: tuple[int, ...] = ()
  policy: Policy = FullCache()
  draft_kv: str = "full"          # "streaming": MagicDec-style sink + window
  draft_sink: int = 16
  draft_window: int = 2032
  impl: str = "auto"              # attention kernels: auto | reference | gpu | tpu
  mesh: Mesh | None = None        # attention runs per device (the draft whole on
                                  # each: sharding.draft_mesh)

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


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """What a caller asks of the step beyond decoding (static: each choice
  compiles its own program; the defaults are the deployed step).

  verify: "sparse" verifies against the policy's I_verify; "full" verifies
    against the whole cache (the lossless trajectory, on which every policy
    can be measured alike) while the policy still selects and observes.
  measure_arr: the ARR of the selected set, from a full-cache target pass
    over the block with every layer tapped (`StepOutput.arr`).
  teacher_forced: the block is given (`forced[B, gamma+1]`: the true next
    tokens) instead of drafted: the draft scores it in one pass, the target
    verifies it, the whole block is committed, and `StepOutput.nll` /
    `target_top1` score it.
  """
  verify: str = "sparse"
  measure_arr: bool = False
  teacher_forced: bool = False

  def __post_init__(self):
    if self.verify not in VERIFY_MODES:
      raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")

  def needs_full_pass(self, policy: Policy) -> bool:
    """Whether the step runs the target over the block with the full cache
    before selecting."""
    return policy.needs_full_verify or self.measure_arr or self.verify == "full"

  def full_pass_layers(self, policy: Policy, num_layers: int) -> tuple[int, ...]:
    """The target layers that full-cache pass taps."""
    layers = set(policy.full_verify_tap_layers)
    if self.measure_arr:
      layers |= set(range(num_layers))
    if self.verify == "full":
      layers |= set(policy.target_tap_layers)
    return tuple(sorted(layers))


# ------------------------------------------------------------------ phases
def draft_phase(graphdef, params, cache: KVCache, ds: DecodeState, signals, cfg: SpecConfig,
                forced=None):
  """gamma draft tokens, their draft distributions [B, gamma, V_d] (None
  under greedy sampling, whose acceptance compares tokens) and the policy's
  lookahead signal (its gamma queries scored in one call). The
  draft cache gets rows for prev, pending and d_1 .. d_{gamma-1}; its
  committed length is not moved. With `forced[B, gamma+1]` (teacher
  forcing) the drafts are `forced[:, :gamma]`, run in one pass for their
  lookahead signal, and no distributions are returned (None)."""
  model = nnx.merge(graphdef, params)
  policy = cfg.policy
  base = cache.lengths
  mesh = draft_mesh(cfg.mesh)

  def forward(c, tokens, at):
    """Run `tokens[B, n]`, the first at positions `at[b]`: logits of the last."""
    window = (cfg.draft_sink, cfg.draft_window) if cfg.draft_kv == "streaming" else None
    hidden, c, taps = model(tokens, c.with_lengths(at), window=window,
                            tap_layers=policy.draft_tap_layers, impl=cfg.impl,
                            mesh=mesh)
    return model.logits(hidden[:, -1]), taps, c

  if forced is not None:
    tokens = jnp.concatenate([ds.prev[:, None], ds.pending[:, None], forced[:, :cfg.gamma - 1]], 1)
    _, taps, c = forward(cache, tokens, base - 1)
    lookahead = {layer: q[:, 1:] for layer, q in taps.items()}
    with jax.named_scope("estimate"):
      signals = policy.observe_draft(signals, lookahead, c.with_lengths(base))
    return forced[:, :cfg.gamma], None, c.with_lengths(base), signals, ds.rng

  keys = jax.random.split(ds.rng, cfg.gamma + 1)
  logits, taps, cache = forward(cache, jnp.stack([ds.prev, ds.pending], 1), base - 1)
  # the lookahead queries are those that predict d_1 .. d_gamma: pending's first
  first_taps = {layer: q[:, 1:] for layer, q in taps.items()}
  tok, q = next_tokens(keys[1], logits, cfg.sampling)

  def body(carry, xs):
    cache, tok = carry
    i, key = xs
    logits, taps, cache = forward(cache, tok[:, None], base + i)
    nxt, q = next_tokens(key, logits, cfg.sampling)
    return (cache, nxt), (nxt, q, taps)

  # unrolled: on XLA:GPU a while loop waits on the host at every iteration
  (c, _), (toks, qs, scan_taps) = jax.lax.scan(
      body, (cache, tok), (jnp.arange(1, cfg.gamma), keys[2:]), unroll=max(cfg.gamma - 1, 1))
  drafts = jnp.concatenate([tok[:, None], jnp.moveaxis(toks, 0, 1)], axis=1)
  q_all = None if q is None else jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
  # the lookahead signal from all gamma queries at once, after drafting: every
  # key they attend to is written by now, and one scoring reads the SRH keys
  # once instead of gamma times
  lookahead = {layer: jnp.concatenate([q0, jnp.moveaxis(scan_taps[layer], 0, 1)[:, :, 0]], 1)
               for layer, q0 in first_taps.items()}
  with jax.named_scope("estimate"):
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
  with jax.named_scope("estimate"):
    signals = cfg.policy.observe_target(signals, taps, cache, cfg.gamma)
  return model.logits(hidden), cache, signals


def accept(target_logits, draft_probs, drafts, rng, sampling: SamplingConfig):
  """Leviathan/Chen acceptance. Returns (tokens[B, gamma+1] = accepted
  drafts then the correction or bonus token, n_accepted[B]).

  Greedy: a draft token is accepted iff it is the target's argmax
  (`draft_probs` unused, may be None). Sampling: accepted with probability
  min(1, p/q); at the first rejection the token is drawn from
  norm(max(p - q, 0)), after full acceptance from p."""
  b, gamma = drafts.shape
  if sampling.greedy:
    best = jnp.argmax(target_logits, -1).astype(jnp.int32)  # [B, gamma+1]
    ok = best[:, :gamma] == drafts
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    fix = jnp.take_along_axis(best, n_acc[:, None], axis=1)[:, 0]
  else:
    vocab = max(target_logits.shape[-1], draft_probs.shape[-1])
    target_logits = pad_vocab(target_logits, vocab)
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


def full_verify_pass(graphdef, params, cache: KVCache, ds: DecodeState, drafts,
                     tap_layers: tuple[int, ...], cfg: SpecConfig):
  """The target over [pending, d_1 .. d_gamma] with the full cache, the
  given layers tapped: (hidden, cache with the block written, taps)."""
  model = nnx.merge(graphdef, params)
  block = jnp.concatenate([ds.pending[:, None], drafts], axis=1)
  return model(block, cache, tap_layers=tap_layers, impl=cfg.impl, mesh=cfg.mesh)


def forced_tokens(target_logits, forced):
  """Teacher forcing's accept: the whole block; its nll f32[B, gamma+1] and
  the target's argmax int32[B, gamma+1]."""
  logp = jax.nn.log_softmax(target_logits.astype(jnp.float32), -1)
  nll = -jnp.take_along_axis(logp, forced[:, :, None], -1)[..., 0]
  n_acc = jnp.full(forced.shape[:1], forced.shape[1] - 1, jnp.int32)
  return forced, n_acc, nll, jnp.argmax(target_logits, -1).astype(jnp.int32)


# -------------------------------------------------------------- the step
def spec_step_fn(target_graphdef, target_params, draft_graphdef, draft_params,
                 st: SpecState, cfg: SpecConfig, options: StepOptions = StepOptions(),
                 forced=None):
  """One speculative step: (new state, StepOutput). The unjitted function
  (compose, shard or time it); `spec_step` is the jitted one. `forced`:
  the block of a teacher-forced step (`options.teacher_forced`)."""
  if options.teacher_forced != (forced is not None):
    raise ValueError("pass `forced` tokens exactly when options.teacher_forced is set")
  ds, policy = st.decode, cfg.policy
  with jax.named_scope("draft"):  # 1. gamma draft tokens (+ the draft-lookahead signal)
    drafts, q, draft_cache, signals, rng = draft_phase(
        draft_graphdef, draft_params, st.draft, ds, st.signals, cfg, forced)
  full = None
  if options.needs_full_pass(policy):
    with jax.named_scope("full_verify"):  # evaluation: the target with the whole cache
      layers = options.full_pass_layers(
          policy, nnx.merge(target_graphdef, target_params).cfg.num_layers)
      full = full_verify_pass(target_graphdef, target_params, st.target, ds, drafts, layers, cfg)
      signals = policy.observe_full_verify(signals, full[2], full[1], cfg.gamma)
  with jax.named_scope("select"):  # 2. the verification set I_verify from the signals
    kv_indices = policy.select(signals, st.target, cfg.gamma)
  with jax.named_scope("verify"):  # 3. all gamma+1 positions at once (+ the target signal)
    if options.verify == "full":
      hidden, target_cache, taps = full
      logits = nnx.merge(target_graphdef, target_params).logits(hidden)
      signals = policy.observe_target(signals, {l: taps[l] for l in policy.target_tap_layers},
                                      target_cache, cfg.gamma)
    else:
      logits, target_cache, signals = verify_phase(
          target_graphdef, target_params, st.target, ds, drafts, kv_indices, signals, cfg)
  with jax.named_scope("accept"):  # 4. accepted drafts + the correction or bonus token
    rng, key = jax.random.split(rng)
    nll = top1 = None
    if forced is not None:
      tokens, n_acc, nll, top1 = forced_tokens(logits, forced)
    else:
      tokens, n_acc = accept(logits, q, drafts, key, cfg.sampling)
  with jax.named_scope("commit"):  # 5. emit and advance both caches
    ds = dataclasses.replace(ds, rng=rng)
    new, out, n, active = commit_phase(target_cache, draft_cache, ds, tokens, n_acc, signals,
                                       cfg)
  arr = per_layer = None
  if options.measure_arr:
    arr, per_layer = arr_of_indices(layer_weights(full[2], full[1], impl=cfg.impl), kv_indices,
                                    st.target.lengths)
  return new, StepOutput(out, n, jnp.where(active, n_acc, 0), active, new.decode.done,
                         kv_indices, arr, per_layer, nll, top1)


spec_step = jax.jit(spec_step_fn, static_argnames=("target_graphdef", "draft_graphdef", "cfg",
                                                   "options"),
                    donate_argnames=("st",))


def bind_spec_step(target: Model, draft: Model, cfg: SpecConfig,
                   options: StepOptions = StepOptions()) -> BoundStep:
  """`spec_step` for a decode loop: `step(st[, forced]) -> (st, out)`, the
  state donated, with cheap dispatch and the output written in place (see
  `BoundStep`)."""
  return BoundStep(_bindable_step_fn, (target, draft), donate=(0,), outputs_from=1, cfg=cfg,
                   options=options)


def _bindable_step_fn(target_graphdef, target_params, draft_graphdef, draft_params, st,
                      forced=None, *, cfg, options):
  # BoundStep passes the per-call arguments (state, forced) positionally
  return spec_step_fn(target_graphdef, target_params, draft_graphdef, draft_params, st, cfg,
                      options, forced)
