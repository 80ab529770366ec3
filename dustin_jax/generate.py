"""Prefill, per-sequence stop control, and plain autoregressive decoding.

Conventions shared with the speculative engine:
- `prefill` puts `prompt[:-1]` into the cache; the last prompt token is the
  first *pending* token: emitted (or given) but not yet in any cache. Every
  step feeds the pending token first, so each step writes `n + 1` rows and
  commits exactly as many rows as it emits tokens.
- Stop control (EOS, max new tokens) is per sequence; a finished sequence
  emits nothing and stops advancing its cache while the batch goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dustin_jax.cache import KVCache
from dustin_jax.config import ModelConfig
from dustin_jax.progress import progress as progress_bar
from dustin_jax.sampling import SamplingConfig, probs, sample


class Model(NamedTuple):
  """A decoder as the jitted functions take it: `graphdef` is static."""
  cfg: ModelConfig
  graphdef: nnx.GraphDef
  state: nnx.State


class InputError(ValueError):
  """Inputs that cannot be decoded as asked (too long, empty, ...)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  pending: jax.Array        # int32[B] last token, not yet in the caches
  prev: jax.Array           # int32[B] the token before it (the last cache row)
  num_generated: jax.Array  # int32[B]
  max_new: jax.Array        # int32[B]
  done: jax.Array           # bool[B]
  rng: jax.Array

  @classmethod
  def init(cls, prompts, max_new_tokens, rng) -> "DecodeState":
    pending = jnp.asarray([p[-1] for p in prompts], jnp.int32)
    prev = jnp.asarray([p[-2] if len(p) > 1 else -1 for p in prompts], jnp.int32)
    b = pending.shape[0]
    max_new = jnp.broadcast_to(jnp.asarray(max_new_tokens, jnp.int32), (b,))
    return cls(pending=pending, prev=prev, num_generated=jnp.zeros((b,), jnp.int32),
               max_new=max_new, done=max_new <= 0, rng=rng)


def emit(ds: DecodeState, tokens: jax.Array, n_valid: jax.Array,
         eos_ids: tuple[int, ...]):
  """Emit up to `n_valid[b]` of `tokens[B, n]`, cut after the first EOS and
  at the sequence's max-new budget; nothing for finished sequences.

  Returns (state, tokens with -1 where not emitted, number emitted[B]).
  """
  b, n = tokens.shape
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  is_eos = jnp.zeros(tokens.shape, bool)
  for e in eos_ids:
    is_eos |= tokens == e
  first_eos = jnp.min(jnp.where(is_eos & (pos < n_valid[:, None]), pos, n), axis=1)
  count = jnp.minimum(n_valid, first_eos + 1)
  count = jnp.minimum(count, ds.max_new - ds.num_generated)
  count = jnp.where(ds.done, 0, count).astype(jnp.int32)
  out = jnp.where(pos < count[:, None], tokens, -1)
  at = lambda i: jnp.take_along_axis(tokens, jnp.maximum(i, 0)[:, None], axis=1)[:, 0]
  last, before_last = at(count - 1), at(count - 2)
  hit_eos = first_eos < count
  num_generated = ds.num_generated + count
  ds = dataclasses.replace(
      ds,
      pending=jnp.where(count > 0, last, ds.pending),
      prev=jnp.where(count > 1, before_last, jnp.where(count == 1, ds.pending, ds.prev)),
      num_generated=num_generated,
      done=ds.done | hit_eos | (num_generated >= ds.max_new))
  return ds, out, count


@dataclasses.dataclass
class DecodeStats:
  """Counters of one decode run (vanilla: gamma = 0, tau = 1)."""
  steps: int = 0
  tokens: int = 0              # emitted, all sequences
  seq_steps: int = 0           # (sequence, step) pairs with the sequence active
  accepted: int = 0            # accepted draft tokens over those pairs
  gamma: int = 0
  prefill_s: float = 0.0
  decode_s: float = 0.0

  @property
  def tau(self) -> float:
    """Mean tokens per verification: accepted drafts + 1."""
    return (self.accepted + self.seq_steps) / max(self.seq_steps, 1)

  @property
  def acceptance_rate(self) -> float:
    return self.accepted / max(self.seq_steps * self.gamma, 1) if self.gamma else 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.decode_s if self.decode_s else 0.0

  def record(self, n_emitted, active, n_accepted=None) -> int:
    """Count one step: per-sequence emitted tokens, active flags (or their
    count) and accepted draft tokens. Returns the tokens emitted."""
    self.steps += 1
    self.tokens += int(np.sum(n_emitted))
    self.seq_steps += int(np.sum(active))
    if n_accepted is not None:
      self.accepted += int(np.sum(n_accepted))
    return int(np.sum(n_emitted))

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
    return d



# ------------------------------------------------------------------ prefill
@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "mesh"),
                   donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, cache: KVCache, tokens, n_valid, impl="auto", mesh=None):
  model = nnx.merge(graphdef, state)
  _, cache, _ = model(tokens, cache, impl=impl, mesh=mesh)
  return cache.commit(n_valid)


def check_lengths(prompt_lengths: Sequence[int], max_new_tokens: int, max_len: int,
                  block: int = 1) -> None:
  """One clear error before any work if a sequence cannot fit its cache."""
  if not prompt_lengths or min(prompt_lengths) < 1:
    raise InputError("every prompt needs at least one token")
  need = max(prompt_lengths) - 1 + max_new_tokens + block
  if need > max_len:
    raise InputError(
        f"prompt of {max(prompt_lengths)} tokens + {max_new_tokens} new tokens "
        f"(+{block} rows of work space) needs a cache of {need} rows, but max_len is "
        f"{max_len}: raise max_len, shorten the prompt or generate fewer tokens")


def prefill(model: Model, cache: KVCache, prompts: Sequence[Sequence[int]], *,
            chunk: int = 256, impl: str = "auto", mesh=None,
            progress: bool = False) -> KVCache:
  """Write `prompt[:-1]` of each (ragged) prompt into an empty cache, in
  chunks of `chunk` tokens so that a long prompt never builds an S x S mask.
  Returns the cache; the last prompt tokens are the pending tokens."""
  b = cache.batch
  if len(prompts) != b:
    raise InputError(f"{len(prompts)} prompts for a batch of {b}")
  bodies = [list(p)[:-1] for p in prompts]
  longest = max((len(p) for p in bodies), default=0)
  # short prompts: a smaller chunk (a power of two, so few distinct compiles)
  chunk = min(chunk, max(16, 1 << max(longest - 1, 0).bit_length()))
  n_chunks = -(-longest // chunk)
  bar = progress_bar(desc="prefill", total=n_chunks, enabled=progress)
  for c in range(n_chunks):
    tok = np.zeros((b, chunk), np.int32)
    n_valid = np.zeros((b,), np.int32)
    for i, p in enumerate(bodies):
      part = p[c * chunk:(c + 1) * chunk]
      tok[i, :len(part)] = part
      n_valid[i] = len(part)
    tok, n_valid = jnp.asarray(tok), jnp.asarray(n_valid)
    if mesh is not None:
      from dustin_jax.sharding import shard_batch_tree
      tok, n_valid = shard_batch_tree((tok, n_valid), mesh)
    cache = _prefill_chunk(model.graphdef, model.state, cache, tok, n_valid, impl=impl, mesh=mesh)
    bar.update(1)
  bar.close()
  return cache


# ------------------------------------------------------------- vanilla step
def vanilla_step_fn(graphdef, state, cache: KVCache, ds: DecodeState, *,
                 sampling: SamplingConfig, eos_ids: tuple[int, ...] = (),
                 impl: str = "auto", mesh=None):
  """One token of plain autoregressive decoding for the whole batch.
  Returns (cache, state, tokens[B, 1] (-1: none), n_emitted[B])."""
  model = nnx.merge(graphdef, state)
  hidden, cache, _ = model(ds.pending[:, None], cache, impl=impl, mesh=mesh)
  logits = model.logits(hidden[:, 0])
  rng, key = jax.random.split(ds.rng)
  tok = sample(key, probs(logits, sampling))
  ds, out, n = emit(dataclasses.replace(ds, rng=rng), tok[:, None], jnp.ones_like(tok), eos_ids)
  return cache.commit(n), ds, out, n


vanilla_step = jax.jit(vanilla_step_fn, static_argnames=("graphdef", "sampling", "eos_ids", "impl",
                                                         "mesh"), donate_argnames=("cache",))


class BoundStep:
  """A jitted step with its models bound: `fn(graphdef_1, params_1, ...,
  graphdef_n, params_n, *args, **static)` becomes `step(*args)`.

  Why: a plain jitted call hashes its static arguments and flattens its
  pytrees on every call. For nnx graphdefs (~1 ms to hash each) and States
  of a few hundred arrays that is milliseconds of host time per step
  (measured 6-8 ms for a 7B + 0.5B step on the CPU machine, against 2-3 ms
  bound), paid on every step of a decode loop. Here the graphdefs and the
  static settings are closed over and the params flattened once; the args
  at positions `donate` are donated. The params are bound: bind again after
  replacing them.

  `outputs_from`: the results from that position on (the step's outputs, not
  its carried state) are written into buffers the step owns, donated back
  into every call, and the caller gets copies of them (a second, one-kernel
  executable). Why: on GPU, XLA launches the step as one CUDA graph and
  re-records every command that touches a buffer whose address changed
  since the last launch. Freshly allocated outputs change address every
  step, and XLA also places the step's temporaries in them, so with fresh
  outputs XLA re-recorded nearly all 1881 commands of the 7B + 0.5B
  speculative step before every launch (~10 ms of host time per step on
  the H200, `results/h200/host_dispatch/`). With every result aliased to a
  donated input only the temporary buffer can still move between launches;
  `dustin_jax.config.STABLE_GRAPH_FLAG` pins that one too."""

  def __init__(self, fn, models: Sequence[Model], donate: tuple[int, ...] = (0,),
               *, outputs_from: int, **static):
    leaves, defs = zip(*(jax.tree_util.tree_flatten(m.state) for m in models))
    self._params = tuple(leaves)
    self._outputs_from = outputs_from
    self._slots = None  # (arg shapes, output buffers) of the last call
    # one jitted function per (step, models' structure, settings): binding
    # again (each generate call) reuses its compiled executables
    self._jitted = _bound_jit(fn, tuple(m.graphdef for m in models), defs, tuple(donate),
                              tuple(sorted(static.items())))

  def __call__(self, *args):
    key, slots = self._slots_for(args)
    res = self._jitted(self._params, *args, slots=slots)
    k = self._outputs_from
    self._slots = (key, res[k:])
    return (*res[:k], *_copy_tree(res[k:]))

  def _slots_for(self, args):
    """Output buffers for args of these shapes: the last call's, or zeros."""
    key = tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args))
    if self._slots is not None and self._slots[0] == key:
      return self._slots
    shapes = jax.eval_shape(lambda *a: self._jitted(self._params, *a), *args)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype, device=getattr(s, "sharding", None))
    return key, jax.tree_util.tree_map(zeros, shapes[self._outputs_from:])

  def lower(self, *args):
    return self._jitted.lower(self._params, *args, slots=self._slots_for(args)[1])

  def compiled_count(self) -> int:
    """Executables compiled so far for this step (one per input shape)."""
    return self._jitted._cache_size()


@jax.jit
def _copy_tree(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


@functools.lru_cache(maxsize=64)
def _bound_jit(fn, graphdefs, treedefs, donate, static):
  def flat(params, *args, slots=()):
    # `slots` is donated and comes last, after the state: jit pairs donated
    # inputs with results of the same shape in order, so the state's results
    # take the state's buffers and the outputs take the slots' (see BoundStep)
    del slots
    bound = []
    for g, d, p in zip(graphdefs, treedefs, params):
      bound += [g, jax.tree_util.tree_unflatten(d, p)]
    return fn(*bound, *args, **dict(static))
  # keep_unused: a donated input the step never reads (a signal it only
  # overwrites) stays a parameter, so its result is aliased to it too
  return jax.jit(flat, donate_argnums=tuple(1 + i for i in donate),
                 donate_argnames=("slots",), keep_unused=True)


def bind_vanilla_step(model: Model, *, sampling: SamplingConfig = SamplingConfig(),
                      eos_ids: tuple[int, ...] = (), impl: str = "auto", mesh=None):
  """`step(cache, ds) -> (cache, ds, tokens, n_emitted)`, the cache donated,
  the rest written in place (see `BoundStep`)."""
  return BoundStep(vanilla_step_fn, (model,), donate=(0,), outputs_from=1, sampling=sampling,
                   eos_ids=tuple(eos_ids), impl=impl, mesh=mesh)


def collect(out_tokens: list[np.ndarray]) -> list[list[int]]:
  """Concatenate per-step emitted tokens [B, n] (-1 = none) per sequence."""
  if not out_tokens:
    return []
  allt = np.concatenate(out_tokens, axis=1)
  return [[int(t) for t in row if t >= 0] for row in allt]


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             max_len: int, sampling: SamplingConfig = SamplingConfig(),
             eos_ids: tuple[int, ...] = (), seed: int = 0, chunk: int = 256,
             impl: str = "auto", mesh=None, progress: bool = False):
  """Plain autoregressive decoding of a ragged batch, the baseline.
  Returns (token lists, DecodeStats)."""
  check_lengths([len(p) for p in prompts], max_new_tokens, max_len)
  stats = DecodeStats(gamma=0)
  t0 = time.perf_counter()
  cache = KVCache.init(model.cfg, len(prompts), max_len, mesh=mesh)
  cache = prefill(model, cache, prompts, chunk=chunk, impl=impl, mesh=mesh, progress=progress)
  ds = DecodeState.init(prompts, max_new_tokens, jax.random.key(seed))
  if mesh is not None:
    from dustin_jax.sharding import shard_batch_tree
    ds = shard_batch_tree(ds, mesh)
  jax.block_until_ready(cache)
  stats.prefill_s = time.perf_counter() - t0
  step = bind_vanilla_step(model, sampling=sampling, eos_ids=eos_ids, impl=impl, mesh=mesh)
  outs = []
  bar = progress_bar(desc="decode", total=max_new_tokens * len(prompts), enabled=progress)
  t0 = time.perf_counter()
  # The host runs one step ahead: step t+1 is queued before step t's tokens
  # are read, so dispatch overlaps the device's work. The step after the
  # last one is wasted (finished sequences emit nothing).
  ahead = step(cache, ds)
  while True:
    active = int(np.sum(~np.asarray(ds.done)))
    if not active:
      break
    cache, ds, out, n = ahead
    ahead = step(cache, ds)
    outs.append(np.asarray(out))
    bar.update(stats.record(n, active))
  stats.decode_s = time.perf_counter() - t0
  bar.close()
  return collect(outs), stats
