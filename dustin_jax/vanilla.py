"""Plain autoregressive decoding: the baseline every speedup is stated against."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dustin_jax.bound_step import BoundStep
from dustin_jax.cache import KVCache
from dustin_jax.compilation import CompileClock
from dustin_jax.decoding import (DecodeState, DecodeStats, Model, StepOutput, check_lengths,
                                 emit)
from dustin_jax.loop import decode_loop
from dustin_jax.models.prefill import DEFAULT_TOKEN_BLOCK
from dustin_jax.prefill import prefill
from dustin_jax.sampling import SamplingConfig, next_tokens
from dustin_jax.sharding import shard_batch_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VanillaState:
  cache: KVCache
  decode: DecodeState


def vanilla_step_fn(graphdef, state, st: VanillaState, *, sampling: SamplingConfig,
                    eos_ids: tuple[int, ...] = (), impl: str = "auto", mesh=None):
  """One token of plain decoding for the whole batch: (state, StepOutput)."""
  model = nnx.merge(graphdef, state)
  ds = st.decode
  hidden, cache, _ = model(ds.pending[:, None], st.cache, impl=impl, mesh=mesh)
  logits = model.logits(hidden[:, 0])
  rng, key = jax.random.split(ds.rng)
  tok, _ = next_tokens(key, logits, sampling)
  active = ~ds.done
  ds, out, n = emit(dataclasses.replace(ds, rng=rng), tok[:, None], jnp.ones_like(tok), eos_ids)
  out = StepOutput(out, n, jnp.zeros_like(n), active, ds.done)
  return VanillaState(cache.commit(n), ds), out


vanilla_step = jax.jit(vanilla_step_fn, static_argnames=("graphdef", "sampling", "eos_ids", "impl",
                                                         "mesh"), donate_argnames=("st",))


def bind_vanilla_step(model: Model, *, sampling: SamplingConfig = SamplingConfig(),
                      eos_ids: tuple[int, ...] = (), impl: str = "auto", mesh=None) -> BoundStep:
  """`step(state) -> (state, StepOutput)`, the state donated, the output
  written in place (see `BoundStep`)."""
  return BoundStep(vanilla_step_fn, (model,), donate=(0,), outputs_from=1, sampling=sampling,
                   eos_ids=tuple(eos_ids), impl=impl, mesh=mesh)


def init_vanilla_state(model: Model, prompts, *, max_new_tokens: int, max_len: int, seed: int = 0,
                       token_block: int = DEFAULT_TOKEN_BLOCK, impl: str = "auto",
                       mesh=None) -> VanillaState:
  """Prefill `prompt[:-1]` and set up the decode state."""
  check_lengths([len(p) for p in prompts], max_new_tokens, max_len)
  cache = KVCache.init(model.cfg, len(prompts), max_len, mesh=mesh)
  cache = prefill(model, cache, prompts, token_block=token_block, impl=impl, mesh=mesh)
  ds = DecodeState.init(prompts, max_new_tokens, jax.random.key(seed))
  if mesh is not None:
    ds = shard_batch_tree(ds, mesh)
  return VanillaState(cache, ds)


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             max_len: int, sampling: SamplingConfig = SamplingConfig(),
             eos_ids: tuple[int, ...] = (), seed: int = 0, token_block: int = DEFAULT_TOKEN_BLOCK,
             impl: str = "auto", mesh=None, progress: bool = False):
  """Plain autoregressive decoding of a ragged batch, the baseline.
  Returns (token lists, DecodeStats)."""
  stats = DecodeStats(gamma=0, prompt_tokens=sum(len(p) - 1 for p in prompts))
  t0 = time.perf_counter()
  with CompileClock() as clock:
    st = jax.block_until_ready(init_vanilla_state(
        model, prompts, max_new_tokens=max_new_tokens, max_len=max_len, seed=seed,
        token_block=token_block, impl=impl, mesh=mesh))
  stats.prefill_s, stats.prefill_compile_s = time.perf_counter() - t0, clock.seconds
  step = bind_vanilla_step(model, sampling=sampling, eos_ids=eos_ids, impl=impl, mesh=mesh)
  tokens, _ = decode_loop(step, st, stats, progress=progress,
                          total=max_new_tokens * len(prompts))
  return tokens, stats
