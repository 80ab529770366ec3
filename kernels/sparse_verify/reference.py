"""Pure-jnp sparse verify attention: the oracle and the fallback.

Query t of sequence b attends to
  * the context rows named by indices[b] (positions, each < lengths[b];
    -1 = padding, masked; duplicate-free), and
  * causally the T block rows lengths[b] .. lengths[b] + t (already in the
    cache).
Same layouts, GQA rule, scale and f32 accumulation as decode_attention.  An
index outside [0, lengths[b]) is treated as padding (the kernels do the same).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common


def extended_positions(indices, lengths, T):
  """(pos, valid) of the gathered list: the K indices then the T block rows."""
  B, K = indices.shape
  idx = indices.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  blk = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  ctx_valid = (idx >= 0) & (idx < lengths[:, None])
  pos = jnp.concatenate([idx, blk], axis=1)
  valid = jnp.concatenate([ctx_valid, jnp.ones((B, T), bool)], axis=1)
  return pos, valid


def sparse_verify_reference(q, k, v, lengths, indices, *, scale=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  if indices.ndim != 2 or indices.shape[0] != B:
    raise ValueError(f"indices must be int32[B, K], got {indices.shape}")
  G = Hq // Hkv
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  pos, valid = extended_positions(indices, lengths, T)  # [B, N]
  safe = jnp.where(valid, pos, 0)
  bi = jnp.arange(B)[:, None, None]
  hi = jnp.arange(Hkv)[None, :, None]
  kg = k[bi, hi, safe[:, None, :]]  # [B, Hkv, N, D]
  vg = v[bi, hi, safe[:, None, :]]
  vg = jnp.where(valid[:, None, :, None], vg.astype(jnp.float32), 0.0)
  dt = jnp.promote_types(q.dtype, k.dtype)
  qg = q.reshape(B, T, Hkv, G, D)
  logits = jnp.einsum("btkgd,bknd->bkgtn", qg.astype(dt), kg.astype(dt),
                      preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST) * scale
  limit = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  allowed = valid[:, None, :] & (pos[:, None, :] <= limit[:, :, None])
  logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgtn,bknd->btkgd", probs, vg,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(B, T, Hq, D).astype(q.dtype)


def sparse_verify_packed_reference(qkv, k_cache, v_cache, lengths, indices,
                                   cos, sin, *, scale=None, attend=None):
  """The verify layer's attention from the packed projection: RoPE of q and
  k_new (`cos, sin` [B, T, D // 2]), the roped k rows and the v rows written
  at lengths[b] + t, then sparse verify attention over `indices` plus the
  block.  qkv [B, T, Hkv, G + 2, D] as `common.unpack_qkv` reads it.  `attend`: the
  sparse_verify implementation (default this reference).  Returns (out,
  k_cache, v_cache)."""
  common.check_packed_shapes(qkv, k_cache, v_cache, lengths, cos, sin)
  q, k_new, v_new = common.unpack_qkv(qkv)
  cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
  lengths = lengths.astype(jnp.int32)
  k_cache = common.write_block(k_cache, common.rope(k_new, cos, sin), lengths)
  v_cache = common.write_block(v_cache, v_new, lengths)
  attend = attend or sparse_verify_reference
  return (attend(common.rope(q, cos, sin), k_cache, v_cache, lengths, indices,
                 scale=scale), k_cache, v_cache)
