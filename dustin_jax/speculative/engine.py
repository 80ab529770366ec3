"""Speculative decoding of a batch of prompts: prefill both models, then the
one host loop (`loop.decode_loop`) over the bound step."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax

from dustin_jax.cache import KVCache
from dustin_jax.compilation import CompileClock
from dustin_jax.config import ModelConfig
from dustin_jax.decoding import DecodeState, DecodeStats, InputError, Model, check_lengths
from dustin_jax.loop import decode_loop
from dustin_jax.models.prefill import DEFAULT_TOKEN_BLOCK
from dustin_jax.prefill import prefill
from dustin_jax.sharding import draft_mesh, shard_batch_tree
from dustin_jax.speculative.step import SpecConfig, SpecState, StepOptions, bind_spec_step


def check_pair(target: ModelConfig, draft: ModelConfig) -> None:
  """Draft and target must share a tokenizer; padded vocab sizes may differ
  (the extra ids are never produced by the tokenizer)."""
  t, d = target.vocab_size, draft.vocab_size
  if min(t, d) < 0.9 * max(t, d):
    raise InputError(f"draft vocab_size {d} and target vocab_size {t} "
                     "differ by more than padding: the models do not share a tokenizer")


def init_state(target: Model, draft: Model, prompts, *, max_new_tokens, max_len, cfg: SpecConfig,
               seed=0, token_block=DEFAULT_TOKEN_BLOCK) -> SpecState:
  """Prefill both caches with `prompt[:-1]` and set up the decode state."""
  check_pair(target.cfg, draft.cfg)
  if min(len(p) for p in prompts) < 2:
    raise InputError("speculative decoding needs prompts of at least 2 tokens")
  check_lengths([len(p) for p in prompts], max_new_tokens, max_len, block=cfg.gamma + 1)
  b, mesh, dmesh = len(prompts), cfg.mesh, draft_mesh(cfg.mesh)
  kw = dict(token_block=token_block, impl=cfg.impl)
  tc = prefill(target, KVCache.init(target.cfg, b, max_len, mesh=mesh), prompts, mesh=mesh, **kw)
  dc = prefill(draft, KVCache.init(draft.cfg, b, max_len, mesh=dmesh), prompts, mesh=dmesh, **kw)
  rest = (DecodeState.init(prompts, max_new_tokens, jax.random.key(seed)),
          cfg.policy.init(b, max_len))
  if mesh is not None:
    rest = shard_batch_tree(rest, mesh)
  return SpecState(tc, dc, *rest)


def generate_speculative(target: Model, draft: Model, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, max_len: int, cfg: SpecConfig = SpecConfig(),
                         options: StepOptions = StepOptions(), seed: int = 0,
                         token_block: int = DEFAULT_TOKEN_BLOCK, progress: bool = False,
                         on_step: Callable | None = None, on_output: Callable | None = None):
  """Speculative decoding of a ragged batch. Returns (token lists, DecodeStats).
  `on_step(state, output)` / `on_output(host_output)`: see `decode_loop`."""
  stats = DecodeStats(gamma=cfg.gamma, prompt_tokens=sum(len(p) - 1 for p in prompts))
  t0 = time.perf_counter()
  with CompileClock() as clock:
    st = jax.block_until_ready(init_state(
        target, draft, prompts, max_new_tokens=max_new_tokens, max_len=max_len, cfg=cfg,
        seed=seed, token_block=token_block))
  stats.prefill_s, stats.prefill_compile_s = time.perf_counter() - t0, clock.seconds
  tokens, _ = decode_loop(bind_spec_step(target, draft, cfg, options), st, stats,
                          on_step=on_step, on_output=on_output, progress=progress,
                          total=max_new_tokens * len(prompts))
  return tokens, stats
