"""Host-side driver: prefill both models, run the jitted step until every
sequence stops, gather tokens and statistics."""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from dustin_jax.cache import KVCache
from dustin_jax.generate import (DecodeState, DecodeStats, InputError, Model, 
                                 check_lengths, collect, prefill)
from dustin_jax.progress import progress as progress_bar
from dustin_jax.sharding import draft_mesh
from dustin_jax.spec.step import SpecConfig, SpecState, bind_spec_step


def check_pair(target: Model, draft: Model) -> None:
  """Draft and target must share a tokenizer; padded vocab sizes may differ
  (the extra ids are never produced by the tokenizer)."""
  t, d = target.cfg, draft.cfg
  if min(t.vocab_size, d.vocab_size) < 0.9 * max(t.vocab_size, d.vocab_size):
    raise InputError(f"draft vocab_size {d.vocab_size} and target vocab_size {t.vocab_size} "
                     "differ by more than padding: the models do not share a tokenizer")


def init_state(target: Model, draft: Model, prompts, *, max_new_tokens, max_len, cfg: SpecConfig,
               seed=0, chunk=256, progress=False) -> SpecState:
  """Prefill both caches with `prompt[:-1]` and set up the decode state."""
  check_pair(target, draft)
  if min(len(p) for p in prompts) < 2:
    raise InputError("speculative decoding needs prompts of at least 2 tokens")
  check_lengths([len(p) for p in prompts], max_new_tokens, max_len, block=cfg.gamma + 1)
  b, mesh, dmesh = len(prompts), cfg.mesh, draft_mesh(cfg.mesh)
  kw = dict(chunk=chunk, impl=cfg.impl, progress=progress)
  tc = prefill(target, KVCache.init(target.cfg, b, max_len, mesh=mesh), prompts, mesh=mesh, **kw)
  dc = prefill(draft, KVCache.init(draft.cfg, b, max_len, mesh=dmesh), prompts, mesh=dmesh, **kw)
  rest = (DecodeState.init(prompts, max_new_tokens, jax.random.key(seed)),
          cfg.policy.init(b, max_len))
  if mesh is not None:
    from dustin_jax.sharding import shard_batch_tree
    rest = shard_batch_tree(rest, mesh)
  return SpecState(tc, dc, *rest)


def generate_speculative(target: Model, draft: Model, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, max_len: int, cfg: SpecConfig = SpecConfig(),
                         seed: int = 0, chunk: int = 256, progress: bool = False,
                         on_step=None):
  """Speculative decoding of a ragged batch. Returns (token lists, DecodeStats).
  `on_step(state, output)` is called after each step (evaluation hooks)."""
  stats = DecodeStats(gamma=cfg.gamma)
  t0 = time.perf_counter()
  st = init_state(target, draft, prompts, max_new_tokens=max_new_tokens, max_len=max_len,
                  cfg=cfg, seed=seed, chunk=chunk, progress=progress)
  jax.block_until_ready(st)
  stats.prefill_s = time.perf_counter() - t0
  step = bind_spec_step(target, draft, cfg)
  outs = []
  bar = progress_bar(desc="decode", total=max_new_tokens * len(prompts), enabled=progress)
  t0 = time.perf_counter()
  st, out = step(st)
  while True:
    if on_step is not None:  # before the next step consumes (donates) the state
      on_step(st, out)
    # queue step t+1 before reading step t: the host's dispatch overlaps the
    # device's work (the step after the last one is wasted)
    st, ahead = step(st)
    tokens, n, n_acc, active, done = jax.device_get(
        (out.tokens, out.n_emitted, out.n_accepted, out.active, out.done))
    outs.append(tokens)
    bar.update(stats.record(n, active, n_acc))
    if bool(np.all(done)):
      break
    out = ahead
  stats.decode_s = time.perf_counter() - t0
  bar.close()
  return collect(outs), stats
