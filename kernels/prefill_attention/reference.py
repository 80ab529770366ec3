"""Pure-jnp blockwise causal prefill attention: the oracle and the CPU path.

Semantics (fixed for the project):
  q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]; lengths: int32[B], 0 <= lengths <= S.
  Token t of sequence b attends to key positions p <= t with p < lengths[b].
  Rows t >= lengths[b] are padding: their output is zero (callers treat it
  as don't-care). Query head h reads KV head h // (Hq // Hkv); the KV heads
  are never repeated. f32 softmax and accumulation; output in q's dtype.

Flash-style: the queries are cut into blocks of ``block_q`` tokens (a loop)
and each block walks the key blocks up to its diagonal with an online
softmax (an inner loop), so no tensor is larger than
``B * Hq * block_q * block_k`` floats: memory O(S * block), not O(S * S).
The inner loop's trip count stops at the block's diagonal, so no key block
wholly above it is ever computed, and at ``max(lengths)``; query blocks past
``max(lengths)`` are not run at all (the padding of a bucketed batch costs
nothing). Both loops are ``fori_loop``s over dynamic slices: one small
program whatever S, where unrolled blocks grow the program (and its
compile time) with (S / block)^2. The G
query heads of one KV head and the tokens of a query block are packed as
the M rows of one batched GEMM (row ``t * G + g``).

Block size, measured on the 2-core CPU (Qwen2.5-Coder 1.5B / 0.5B heads,
8 x 4k, f32): 128 x 128 costs ~4.5 / ~2 ns per causal score (target /
draft); 512 x 512, ~10-25 / ~10 ns. XLA:CPU runs each op of a block over the
whole [B, Hkv, M, block_k] tile in turn, so the tile must stay in cache
(128 x 128: 5-7 MB) and its buffers small (a fresh multi-MB buffer is paid
again in page faults on this VM).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels import common

_HI = lax.Precision.HIGHEST


def check_prefill_shapes(q, k, v, lengths):
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [B,S,Hq,D], k [B,S,Hkv,D]; got {q.shape}, {k.shape}")
  B, S, Hq, D = q.shape
  if k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
    raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch, length or head_dim")
  if v.shape != k.shape:
    raise ValueError(f"v {v.shape} must have the shape of k {k.shape}")
  if Hq % k.shape[2]:
    raise ValueError(f"Hq={Hq} is not a multiple of Hkv={k.shape[2]}")
  if lengths.shape != (B,):
    raise ValueError(f"lengths must be [B]={B}, got {lengths.shape}")
  return B, S, Hq, D, k.shape[2]


def prefill_attention_reference(q, k, v, lengths, *, scale=None, block_q=128,
                                block_k=128):
  B, S, Hq, D, Hkv = check_prefill_shapes(q, k, v, lengths)
  G = Hq // Hkv
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  bq = min(block_q, common.round_up(S, 8))
  bk = min(block_k, common.round_up(S, 8))
  if max(bq, bk) % min(bq, bk):
    raise ValueError(f"block_q={bq} and block_k={bk}: one must divide the other")
  Sp = common.round_up(S, max(bq, bk))
  if Sp != S:  # padded rows sit past every length: masked like any padding
    pad = ((0, 0), (0, Sp - S), (0, 0), (0, 0))
    q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
  dt = jnp.promote_types(q.dtype, jnp.float32)
  # [B, Hkv, Sp, D]; padding rows of V zeroed: a masked key's weight is 0,
  # and 0 * (NaN or inf garbage) would still poison the row
  kt = k.astype(dt).transpose(0, 2, 1, 3)
  live = jnp.arange(Sp, dtype=jnp.int32)[None, :] < lengths[:, None]
  vt = jnp.where(live[:, None, :, None], v.astype(dt).transpose(0, 2, 1, 3), 0.0)
  max_len = jnp.max(lengths)
  M = bq * G
  row_t = jnp.arange(M, dtype=jnp.int32) // G  # token (in its block) of each packed row

  def update(carry, qb, s0, q0):
    """Key block [s0, s0 + bk) into the running (acc, m, l) of the query
    block at q0; the causal mask is applied where the block reaches q0."""
    acc, m, l = carry
    kb = lax.dynamic_slice_in_dim(kt, s0, bk, axis=2)
    vb = lax.dynamic_slice_in_dim(vt, s0, bk, axis=2)
    s = jnp.einsum("bhrd,bhkd->bhrk", qb, kb, precision=_HI,
                   preferred_element_type=jnp.float32)
    pos = s0 + jnp.arange(bk, dtype=jnp.int32)
    ok = (pos[None, :] <= q0 + row_t[:, None])[None, None]
    ok = ok & (pos[None, None, None, :] < lengths[:, None, None, None])
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("bhrk,bhkd->bhrd", p, vb, precision=_HI,
                                             preferred_element_type=jnp.float32)
    return acc, m_new, l

  def query_block(i, buf):
    """Block i's queries (rows [q0, q0 + bq) of `buf`) replaced by its output."""
    q0 = i * bq
    qb = lax.dynamic_slice_in_dim(buf, q0, bq, axis=1).astype(dt) * scale  # [B, bq, Hq, D]
    # [B, Hkv, bq * G, D]: the G heads of a KV head next to each other per token
    qb = qb.reshape(B, bq, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, M, D)
    carry = (jnp.zeros((B, Hkv, M, D), jnp.float32),
             jnp.full((B, Hkv, M), -jnp.inf, jnp.float32),
             jnp.zeros((B, Hkv, M), jnp.float32))
    # key blocks up to the one holding the block's last query and below
    # max(lengths); none above
    n_k = jnp.minimum((q0 + bq + bk - 1) // bk, (max_len + bk - 1) // bk)
    carry = lax.fori_loop(0, n_k, lambda j, c: update(c, qb, j * bk, q0), carry)
    acc, _, l = carry
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]
    o = o.reshape(B, Hkv, bq, G, D).transpose(0, 2, 1, 3, 4).reshape(B, bq, Hq, D)
    return lax.dynamic_update_slice_in_dim(buf, o.astype(buf.dtype), q0, axis=1)

  # The loop writes each block's output over its queries (read just before):
  # the output takes q's buffer, no second [B, S, Hq, D] array. (XLA gives
  # every while loop's carried buffers an allocation of their own that no
  # later loop reuses; a fresh output buffer per call would add up over a
  # model's layers: 0.2 GB per layer for 8 x 4k on the 1.5B.) Query blocks
  # past max(lengths) are not run: their rows (still queries) are zeroed below.
  n_q = (max_len + bq - 1) // bq
  out = lax.fori_loop(0, n_q, query_block, q)[:, :S]
  valid = jnp.arange(S, dtype=jnp.int32)[None, :] < lengths[:, None]
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
