"""Pure-jnp SRH importance scores: the oracle and the fallback.

q: [B, T, n, D] the n selected query heads of one layer; k: [B, Hkv, S, D]
that layer's key cache; kv_head: static tuple, kv_head[i] is the KV head that
selected query head i reads; lengths: int32[B]; q_valid: optional bool[B, T].

For every selected head i and valid query t: softmax over the allowed keys
(p <= lengths[b] + t) of scale * q.k; then scores[b, p] = sum (or max) of
those probabilities over (heads x valid queries).  f32[B, S], zero where no
query may look.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common


def check_srh_args(q, k, kv_head, reduce):
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [B,T,n,D], k [B,Hkv,S,D]; got {q.shape}, {k.shape}")
  B, T, n, D = q.shape
  if k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}")
  kv_head = tuple(int(h) for h in kv_head)
  if len(kv_head) != n:
    raise ValueError(f"kv_head has {len(kv_head)} entries for {n} query heads")
  if any(h < 0 or h >= k.shape[1] for h in kv_head):
    raise ValueError(f"kv_head {kv_head} out of range for Hkv={k.shape[1]}")
  if reduce not in ("sum", "max"):
    raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
  return kv_head


def srh_scores_reference(q, k, lengths, kv_head, *, q_valid=None,
                         reduce="sum", scale=None):
  kv_head = check_srh_args(q, k, kv_head, reduce)
  B, T, n, D = q.shape
  S = k.shape[2]
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  dt = jnp.promote_types(q.dtype, k.dtype)
  # One einsum per distinct KV head: each is read once.
  logits = [None] * n
  for hd in sorted(set(kv_head)):
    heads = [i for i in range(n) if kv_head[i] == hd]
    lg = jnp.einsum("btid,bsd->btis", q[:, :, heads].astype(dt),
                    k[:, hd].astype(dt), preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)
    for c, i in enumerate(heads):
      logits[i] = lg[:, :, c]
  logits = jnp.stack(logits, axis=2) * scale  # [B, T, n, S]
  pos = jnp.arange(S, dtype=jnp.int32)
  limit = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  allowed = pos[None, None, :] <= limit[:, :, None]  # [B, T, S]
  logits = jnp.where(allowed[:, :, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if q_valid is not None:
    probs = jnp.where(q_valid.astype(bool)[:, :, None, None], probs, 0.0)
  if reduce == "sum":
    return jnp.sum(probs, axis=(1, 2))
  return jnp.max(probs, axis=(1, 2))
