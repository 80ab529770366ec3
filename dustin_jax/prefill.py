"""Prefill: write each prompt (but its last token) into an empty KV cache.

The last prompt token is the first pending token of the decode (see
`decoding`), so the cache holds `prompt[:-1]` and `lengths[b] = len(prompt) - 1`.

`prefill` runs the prompts layer-major with causal flash attention over the
prompt only (`models.prefill`).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from dustin_jax.cache import KVCache
from dustin_jax.decoding import InputError, Model
from dustin_jax.models.prefill import DEFAULT_TOKEN_BLOCK, pack_prompts, prefill_cache
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
