"""Pure-jnp window attention with the new rows written: the oracle and the
fallback.

The q, k_new, v_new of the T new tokens come packed as qkv [B, T, Hkv,
G + 2, D] (G = Hq // Hkv; the layout of the model's fused q/k/v projection):
qkv[:, :, h, :G] are the query heads h * G .. h * G + G - 1, qkv[:, :, h, G]
is k_new and qkv[:, :, h, G + 1] is v_new of KV head h.

For sequence b with L = lengths[b] context rows already in the cache:
  1. RoPE (rotate-half, f32, cast back to the input dtype) of q and k_new
     with the tables cos, sin of the T new positions;
  2. the roped k_new rows and the v_new rows are written into the caches at
     rows L .. L + T - 1 (rows at or past S are dropped, as
     ``dustin_jax.cache.write_rows`` does);
  3. query t (position L + t) attends, with GQA (query head h reads KV head
     h // (Hq // Hkv)), to the sink rows [0, min(n_sink, L)), the window rows
     [max(n_sink, L - n_window), L) and the block rows L .. L + t.  Softmax and
     accumulation in f32; output in q's dtype.
Only the n_sink + n_window + T candidate rows are gathered, so the cost does
not grow with the context.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common


def rope(x, cos, sin):
  """x: [B, T, H, D]; cos, sin: [B, T, D // 2] f32.  Rotate-half RoPE in f32,
  cast to x's dtype: the same arithmetic as the model's ``apply_rope`` with
  its tables [cos, cos] and [sin, sin]."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  c = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
  s = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
  return (xf * c + rotated * s).astype(x.dtype)


def write_block(cache, new, lengths):
  """cache [B, Hkv, S, D] with new [B, T, Hkv, D] at rows lengths[b] + t
  (rows past S dropped)."""
  B, T = new.shape[:2]
  rows = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  seq = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  return cache.at[seq, :, rows].set(new.astype(cache.dtype), mode="drop")


def window_positions(lengths, n_sink, n_window, T):
  """(pos, ctx_ok) of the rows a sequence may attend to: the n_sink sink
  slots, the n_window window slots, then the T block rows; ctx_ok marks the
  context slots that hold a row (block slots are True, the causal rule is
  applied per query)."""
  L = lengths[:, None]
  sink = jnp.arange(n_sink, dtype=jnp.int32)[None]
  win = L - n_window + jnp.arange(n_window, dtype=jnp.int32)[None]
  blk = L + jnp.arange(T, dtype=jnp.int32)[None]
  B = lengths.shape[0]
  sink = jnp.broadcast_to(sink, (B, n_sink))
  pos = jnp.concatenate([sink, win, blk], axis=1)
  ok = jnp.concatenate([sink < L, win >= n_sink, jnp.ones((B, T), bool)],
                       axis=1)
  return pos, ok


def unpack_qkv(qkv):
  """(q [B, T, Hq, D], k_new [B, T, Hkv, D], v_new [B, T, Hkv, D]) of the
  packed qkv [B, T, Hkv, G + 2, D]: per KV head h its G query heads (query
  head h * G + g), then k, then v."""
  B, T, Hkv, G2, D = qkv.shape
  G = G2 - 2
  return (qkv[:, :, :, :G].reshape(B, T, Hkv * G, D), qkv[:, :, :, G],
          qkv[:, :, :, G + 1])


def check_shapes(qkv, k_cache, v_cache, lengths, cos, sin, n_sink, n_window):
  """Validates the arguments; returns (B, T, Hq, D, Hkv, S)."""
  if qkv.ndim != 5 or k_cache.ndim != 4:
    raise ValueError(f"qkv must be [B, T, Hkv, G + 2, D], k_cache [B, Hkv, S, "
                     f"D]; got {qkv.shape}, {k_cache.shape}")
  B, T, _, G2, D = qkv.shape
  Hkv, S = k_cache.shape[1:3]
  if k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape:
    raise ValueError(f"k_cache, v_cache must be [B, Hkv, S, D] with qkv's "
                     f"B={B}, D={D}; got {k_cache.shape}, {v_cache.shape}")
  if qkv.shape[2] != Hkv or G2 < 3:
    raise ValueError(f"qkv must be [B, T, Hkv, G + 2, D] with the caches' "
                     f"Hkv={Hkv} and G = Hq // Hkv >= 1; got {qkv.shape}")
  Hq = Hkv * (G2 - 2)
  if D % 2:
    raise ValueError(f"head_dim {D} must be even (RoPE halves)")
  if cos.shape != (B, T, D // 2) or sin.shape != cos.shape:
    raise ValueError(f"cos, sin must be [B, T, D // 2] = {(B, T, D // 2)}; "
                     f"got {cos.shape}, {sin.shape}")
  if lengths.shape != (B,):
    raise ValueError(f"lengths must be int32[B={B}], got {lengths.shape}")
  if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
    raise ValueError(f"caches ({k_cache.dtype}, {v_cache.dtype}) must have "
                     f"qkv's dtype {qkv.dtype}")
  if int(n_sink) < 0 or int(n_window) < 0:
    raise ValueError(f"n_sink={n_sink}, n_window={n_window} must be >= 0")
  return B, T, Hq, D, Hkv, S


def window_attention_reference(qkv, k_cache, v_cache, lengths, cos, sin, *,
                               n_sink, n_window, scale=None):
  """Returns (out [B, T, Hq, D], k_cache, v_cache) with the rows written."""
  B, T, Hq, D, Hkv, S = check_shapes(qkv, k_cache, v_cache, lengths, cos, sin,
                                     n_sink, n_window)
  q, k_new, v_new = unpack_qkv(qkv)
  G = Hq // Hkv
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  cos = cos.astype(jnp.float32)
  sin = sin.astype(jnp.float32)
  qr = rope(q, cos, sin)
  kr = rope(k_new, cos, sin)
  k_cache = write_block(k_cache, kr, lengths)
  v_cache = write_block(v_cache, v_new, lengths)

  pos, ok = window_positions(lengths, int(n_sink), int(n_window), T)  # [B, N]
  safe = jnp.clip(jnp.where(ok, pos, 0), 0, S - 1)
  bi = jnp.arange(B)[:, None, None]
  hi = jnp.arange(Hkv)[None, :, None]
  kg = k_cache[bi, hi, safe[:, None, :]]  # [B, Hkv, N, D]
  vg = v_cache[bi, hi, safe[:, None, :]]
  vg = jnp.where(ok[:, None, :, None], vg.astype(jnp.float32), 0.0)
  logits = jnp.einsum("btkgd,bknd->bkgtn", qr.reshape(B, T, Hkv, G, D), kg,
                      preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST) * scale
  limit = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
  allowed = ok[:, None, :] & (pos[:, None, :] <= limit[:, :, None])  # [B,T,N]
  logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgtn,bknd->btkgd", probs, vg,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(B, T, Hq, D).astype(q.dtype), k_cache, v_cache
