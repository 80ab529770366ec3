"""Prefill: write each prompt (but its last token) into an empty KV cache.

The last prompt token is the first pending token of the decode (see
`decoding`), so the cache holds `prompt[:-1]` and `lengths[b] = len(prompt) - 1`.

`prefill` runs the prompts layer-major with causal flash attention over the
prompt only (`models.prefill`): the fast path. `prefill_chunked` runs them
through the step's decoder in chunks, each attending over the whole cache
with a mask: the reference the fast path is tested against.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dustin_jax.cache import KVCache
from dustin_jax.decoding import InputError, Model
from dustin_jax.models.prefill import DEFAULT_TOKEN_BLOCK, pack_prompts, prefill_cache
from dustin_jax.progress import progress as progress_bar
from dustin_jax.sharding import shard_batch_tree


def prefill(model: Model, cache: KVCache, prompts: Sequence[Sequence[int]], *,
            token_block: int = DEFAULT_TOKEN_BLOCK, impl: str = "auto", mesh=None) -> KVCache:
  """Write `prompt[:-1]` of each (ragged) prompt into an empty cache (lengths
  0) and return it with `lengths[b] = len(prompt) - 1`: one jitted call per
  padded length (`models.prefill.bucket_len`), the per-token work in tiles
  of `token_block` tokens."""
  if len(prompts) != cache.batch:
    raise InputError(f"{len(prompts)} prompts for a batch of {cache.batch}")
  longest = max((len(p) - 1 for p in prompts), default=0)
  if longest > cache.max_len:
    raise InputError(f"prompt of {longest + 1} tokens does not fit a cache of "
                     f"max_len {cache.max_len}")
  if longest <= 0:
    return cache  # nothing to write: every prompt is its pending token
  tok, n = (jnp.asarray(x) for x in pack_prompts(prompts, cache.max_len))
  if mesh is not None:
    tok, n = shard_batch_tree((tok, n), mesh)
  return prefill_cache(model.graphdef, model.state, cache, tok, n, impl=impl,
                       token_block=token_block, mesh=mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "mesh"),
                   donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, cache: KVCache, tokens, n_valid, impl="auto", mesh=None):
  model = nnx.merge(graphdef, state)
  _, cache, _ = model(tokens, cache, impl=impl, mesh=mesh)
  return cache.commit(n_valid)


def prefill_chunked(model: Model, cache: KVCache, prompts: Sequence[Sequence[int]], *,
                    chunk: int = 256, impl: str = "auto", mesh=None,
                    progress: bool = False) -> KVCache:
  """`prefill` through the step's decoder, in chunks of `chunk` tokens that
  attend over the whole cache with a mask (the reference path)."""
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
      tok, n_valid = shard_batch_tree((tok, n_valid), mesh)
    cache = _prefill_chunk(model.graphdef, model.state, cache, tok, n_valid, impl=impl, mesh=mesh)
    bar.update(1)
  bar.close()
  return cache
