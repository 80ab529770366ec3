"""Pure-jnp full-cache verify attention: the oracle and the fallback.

Semantics (fixed for the project):
  q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; lengths: int32[B].
  The T verify tokens already sit in the cache at positions
  lengths[b] .. lengths[b] + T - 1.  Query t of sequence b may attend to key
  position p iff p <= lengths[b] + t.  Anything at p >= lengths[b] + T is stale
  garbage (may be NaN) and never contributes.  Query head h reads KV head
  h // (Hq // Hkv).  f32 softmax and accumulation; output in q's dtype.

Works for any T (chunked prefill uses it with T = chunk size); the only
tensor of size B*Hq*T*S it builds is the attention matrix itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common


def decode_attention_reference(q, k, v, lengths, *, scale=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  G = Hq // Hkv
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  qg = q.reshape(B, T, Hkv, G, D)
  dt = jnp.promote_types(q.dtype, k.dtype)
  # [B, Hkv, G, T, S] logits in f32 (bf16 x bf16 products are exact in f32).
  logits = jnp.einsum("btkgd,bksd->bkgts", qg.astype(dt), k.astype(dt),
                      preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST) * scale
  pos = jnp.arange(S, dtype=jnp.int32)
  limit = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  allowed = pos[None, None, :] <= limit[:, :, None]  # [B, T, S]
  logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  # Stale slots may hold NaN/inf: zero them so 0 * garbage cannot leak.
  live = pos[None, :] < (lengths + T)[:, None]  # [B, S]
  v32 = jnp.where(live[:, None, :, None], v.astype(jnp.float32), 0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, v32,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(B, T, Hq, D).astype(q.dtype)
