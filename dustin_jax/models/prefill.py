"""Layer-major prefill of an empty KV cache.

The step's decoder could prefill in chunks of tokens, each attending over
the whole `max_len` cache through a mask (the tests' oracle does). This
runs the prompt batch one layer at a time over all of its tokens instead:

  for each layer:  q, k, v = Block.qkv(x)            per-token, in tiles
                   cache rows [0, lengths) <- k, v   one slice update
                   a = prefill_attention(q, k, v)    causal, whole prompt
                   x = Block.finish(x, a)            per-token, in tiles

so the attention is one causal flash attention per layer (cuDNN on GPU,
splash on TPU, the blockwise jnp reference elsewhere) and never reads a
cache row past the prompt. The per-token work (norms, projections, MLP) runs
over tiles of about `token_block` tokens (all batch rows x a slice of the
sequence), so its largest temporary is `token_block x intermediate_size`
whatever the prompt size (a 7B MLP over 16 x 32k tokens at once would take
20 GB per tensor). The last layer's `finish` is skipped: no cache row
depends on it, and the pending token is run by the first decode step.

The math is the decoder's own (`Block.qkv` / `Block.finish`, `rope_tables`):
nothing of a layer is written twice.

Compiles: the padded prompt length is a bucket (`bucket_len`), so a batch of
any lengths reuses one of a few programs per (batch, cache) shape.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from dustin_jax.cache import KVCache
from dustin_jax.models.decoder import rope_tables
from kernels.common import next_pow2, round_up
from kernels.prefill_attention.ops import prefill_attention

BUCKET_MIN = 512
DEFAULT_TOKEN_BLOCK = 8192


def bucket_len(n: int, max_len: int) -> int:
  """Padded prompt length for a longest prompt body of `n` tokens: a
  multiple of 512, and past 4096 a multiple of an eighth of the next power
  of two (5120, 6144, 7168, 8192, 10240, ...), at most `max_len`. Four
  buckets per octave: at most 25% padding past 4096 tokens (511 tokens
  below), and 20 programs from 1 to 32k tokens, where a multiple of 512
  alone would compile 64."""
  s = round_up(max(n, 1), max(BUCKET_MIN, next_pow2(n) // 8))
  return min(s, max_len)


def _tile_len(batch: int, s: int, token_block: int) -> int:
  """Sequence positions per tile: `token_block` tokens over all batch rows,
  a multiple of 8, at most `s`."""
  t = max(1, token_block // batch)
  if t >= s:
    return s
  return max(8, t - t % 8) if t >= 8 else t


def _tile_loop(fn, ts: int, s: int, carry):
  """`carry = fn(start, n, carry)` for the tiles [start, start + n) of `s`
  sequence positions, `ts` at a time (the last one may be shorter): one
  loop body, so a tile's temporaries are allocated once."""
  n_full, rest = divmod(s, ts)
  if n_full == 1 and not rest:
    return fn(0, s, carry)
  if n_full:
    carry = lax.fori_loop(0, n_full, lambda j, c: fn(j * ts, ts, c), carry)
  if rest:
    carry = fn(n_full * ts, rest, carry)
  return carry


def _tile(a, start, n):
  return lax.dynamic_slice_in_dim(a, start, n, axis=1)


def _put(a, part, start):
  return lax.dynamic_update_slice_in_dim(a, part.astype(a.dtype), start, axis=1)


def _attention(q, k, v, lengths, impl, mesh):
  """`prefill_attention`; under a mesh per device on its own batch rows and
  KV heads (`shard_map`, as `decoder.attention` does: no K/V row crosses
  devices)."""
  if mesh is None:
    return prefill_attention(q, k, v, lengths, impl=impl)
  from dustin_jax import sharding
  q_spec = sharding.heads_spec(q.shape[2], mesh)
  kv_spec = sharding.heads_spec(k.shape[2], mesh)
  if (q_spec[2] is None) != (kv_spec[2] is None):  # heads must stay with their KV head
    q_spec = kv_spec = sharding.heads_spec(1, mesh)
  fn = functools.partial(prefill_attention, impl=impl)
  return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, sharding.batch_spec(1)),
                       out_specs=q_spec, check_vma=False)(q, k, v, lengths)


def _commit_rows(cache_layer, new, valid):
  """Rows [0, S) of `cache_layer` [B, Hkv, S_max, D] from `new` [B, S, Hkv, D]
  where `valid` [B, S]; the other rows keep what they held. A slice update:
  in place when the cache is donated."""
  s = new.shape[1]
  old = cache_layer[:, :, :s]
  rows = jnp.where(valid[:, None, :, None], new.transpose(0, 2, 1, 3).astype(old.dtype), old)
  return lax.dynamic_update_slice(cache_layer, rows, (0, 0, 0, 0))


# One layer as its own jitted function, shared by every layer: traced and
# lowered once per prefill shape instead of once per layer (XLA inlines the
# calls: the compiled program is the same).
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "tile", "impl", "mesh", "last"))
def _prefill_layer(graphdef, state, x, bufs, k_layer, v_layer, valid, lengths, *, cfg, tile,
                   impl, mesh, last):
  """One layer over the whole prompt: (x after it, the buffers of its q, k,
  v for the next layer to reuse, its cache rows k, v). The last layer's
  output feeds no cache row: it returns x unchanged."""
  layer = nnx.merge(graphdef, state)
  s = x.shape[1]

  def qkv_tile(start, n, bufs):
    pos = start + jnp.arange(n, dtype=jnp.int32)[None]
    parts = layer.qkv(_tile(x, start, n), *rope_tables(cfg, pos))
    return tuple(_put(buf, part, start) for buf, part in zip(bufs, parts))

  q, k, v = _tile_loop(qkv_tile, tile, s, bufs)
  k_layer, v_layer = _commit_rows(k_layer, k, valid), _commit_rows(v_layer, v, valid)
  if last:
    return x, bufs, k_layer, v_layer
  attn = _attention(q, k, v, lengths, impl, mesh)

  def finish_tile(start, n, x):
    return _put(x, layer.finish(_tile(x, start, n), _tile(attn, start, n)), start)

  return _tile_loop(finish_tile, tile, s, x), (attn, k, v), k_layer, v_layer


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "token_block", "mesh"),
                   donate_argnames=("cache",))
def prefill_cache(graphdef, state, cache: KVCache, tokens, lengths, *, impl: str = "auto",
                  token_block: int = DEFAULT_TOKEN_BLOCK, mesh=None) -> KVCache:
  """Write the K/V of `tokens[b, :lengths[b]]` (right-padded `[B, S_pad]`)
  into an EMPTY cache at rows 0.. and set `cache.lengths = lengths` (rows
  past them are left as they were). `S_pad <= cache.max_len`. `impl`: the
  prefill attention's ("auto": cuDNN on GPU, splash on TPU, the jnp
  reference elsewhere). `token_block`: tokens per tile of the per-token
  work. `mesh`: attention under `shard_map` (batch over "data", KV heads
  over "model"); the rest is partitioned by XLA from the params' and
  cache's shardings."""
  model = nnx.merge(graphdef, state)
  cfg = model.cfg
  b, s = tokens.shape
  if s > cache.max_len:
    raise ValueError(f"padded prompt of {s} tokens > cache max_len {cache.max_len}")
  lengths = lengths.astype(jnp.int32)
  valid = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths[:, None]
  ts = _tile_len(b, s, token_block)
  x = jnp.take(model.embed_tokens[...], tokens, axis=0)
  hd, dt = cfg.head_dim, x.dtype
  # The tile loops write into buffers they carry, and XLA gives every loop's
  # carried buffers an allocation of their own that no later loop reuses
  # (measured: +0.7 GB per layer for the 1.5B at 8 x 4k, 20 GB in all). So
  # each layer writes into the previous layer's dead buffers (q's buffer
  # holds the attention output, which the next layer's q overwrites; k, v
  # likewise) and x is updated in place: one set of buffers for all layers.
  bufs = (jnp.zeros((b, s, cfg.num_heads, hd), dt), jnp.zeros((b, s, cfg.num_kv_heads, hd), dt),
          jnp.zeros((b, s, cfg.num_kv_heads, hd), dt))
  last = len(model.layers) - 1
  for i, layer in enumerate(model.layers):
    graphdef, layer_state = nnx.split(layer)
    x, bufs, k_rows, v_rows = _prefill_layer(
        graphdef, layer_state, x, bufs, cache.k[i], cache.v[i], valid, lengths, cfg=cfg,
        tile=ts, impl=impl, mesh=mesh, last=i == last)
    cache = cache.with_layer(i, k_rows, v_rows)
  return cache.with_lengths(lengths)


def pack_prompts(prompts: Sequence[Sequence[int]], max_len: int):
  """(tokens int32[B, bucket_len], lengths int32[B]) of `prompt[:-1]` of
  each prompt, right-padded with 0, as numpy arrays."""
  bodies = [list(p)[:-1] for p in prompts]
  longest = max((len(p) for p in bodies), default=0)
  s = bucket_len(longest, max_len)
  tok = np.zeros((len(bodies), s), np.int32)
  n = np.zeros((len(bodies),), np.int32)
  for i, p in enumerate(bodies):
    tok[i, :len(p)] = p
    n[i] = len(p)
  return tok, n
