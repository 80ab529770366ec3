"""Sparse verify attention, Pallas with Triton lowering (row gather).

Grid (B, Hkv, J).  The list a sequence attends to is the K indices followed by
the T block rows lengths[b] .. lengths[b] + T - 1; the kernel builds that list
on the fly (no XLA pre-pass) and program (b, h, j) walks its share of it in
blocks of ``block_k`` entries: one masked row gather of K and of V per block
([block_k, D], each row contiguous), shared by the G heads x T queries packed
as the M rows of the tile (row r = t * G + g).  Queries are read from, and the
output written to, the natural [B, T, Hq, D] layout by row gather/scatter, so
with J == 1 the whole op is one kernel launch; with J > 1 partials are merged
by :func:`kernels.common.combine_partials`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common


def _dot(a, b, trans_b=False):
  prec = (lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)
  return plt.dot(a, b, trans_b=trans_b, precision=prec)


def _kernel(len_ref, idx_ref, q_ref, k_ref, v_ref, *out_refs, T, G, Hq, M, D,
            BK, NBP, K, S, scale_log2, direct):
  b = pl.program_id(0)
  h = pl.program_id(1)
  j = pl.program_id(2)
  L = len_ref[b]

  r = jnp.arange(M, dtype=jnp.int32)
  cols = jnp.arange(D, dtype=jnp.int32)
  t_r = r // G
  row_ok = r < G * T
  R = T * Hq
  qrow = jnp.where(row_ok, t_r * Hq + h * G + (r % G), R)
  qlim = L + t_r
  q = plt.load(q_ref.at[b, qrow[:, None], cols[None, :]],
               mask=row_ok[:, None], other=0.0)
  base = j * (NBP * BK)

  def step(i, carry):
    o, m, l = carry
    e0 = base + i * BK
    e = e0 + jnp.arange(BK, dtype=jnp.int32)  # entry in the extended list
    is_ctx = e < K
    ctx = plt.load(idx_ref.at[b, pl.ds(e0, BK)], mask=is_ctx, other=-1)
    pos = jnp.where(is_ctx, ctx, L + (e - K))
    valid = jnp.where(is_ctx, (ctx >= 0) & (ctx < L), e < K + T) & (pos < S)
    rows = jnp.where(valid, pos, 0)
    k = plt.load(k_ref.at[b, h, rows[:, None], cols[None, :]],
                 mask=valid[:, None], other=0.0)
    v = plt.load(v_ref.at[b, h, rows[:, None], cols[None, :]],
                 mask=valid[:, None], other=0.0)
    s = _dot(q, k, trans_b=True) * scale_log2
    allowed = valid[None, :] & (pos[None, :] <= qlim[:, None])
    s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    o = o * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return o, m_new, l

  init = (jnp.zeros((M, D), jnp.float32),
          jnp.full((M,), -jnp.inf, jnp.float32),
          jnp.zeros((M,), jnp.float32))
  o, m, l = lax.fori_loop(0, NBP, step, init)
  if direct:
    (out_ref,) = out_refs
    out = (o / l[:, None]).astype(out_ref.dtype)
    plt.store(out_ref.at[b, qrow[:, None], cols[None, :]], out,
              mask=row_ok[:, None])
  else:
    o_ref, m_ref, l_ref = out_refs
    plt.store(o_ref.at[j, b, qrow[:, None], cols[None, :]], o,
              mask=row_ok[:, None])
    plt.store(m_ref.at[j, b, qrow], m, mask=row_ok)
    plt.store(l_ref.at[j, b, qrow], l, mask=row_ok)


def default_tuning(B, Hkv, K, T):
  block_k = 64 if K + T > 256 else 32
  n_blocks = common.cdiv(K + T, block_k)
  splits = max(1, min(n_blocks, round(common.num_sms() / (B * Hkv))))
  return dict(block_k=block_k, splits=splits, num_warps=4, num_stages=3)


def sparse_verify_gpu(q, k, v, lengths, indices, *, scale=None,
                      interpret=False, block_k=None, splits=None,
                      num_warps=None, num_stages=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  if indices.ndim != 2 or indices.shape[0] != B:
    raise ValueError(f"indices must be int32[B, K], got {indices.shape}")
  K = indices.shape[1]
  G = Hq // Hkv
  tune = default_tuning(B, Hkv, K, T)
  block_k = block_k or tune["block_k"]
  num_warps = num_warps or tune["num_warps"]
  num_stages = num_stages or tune["num_stages"]
  if D & (D - 1) or block_k & (block_k - 1) or block_k < 16:
    raise ValueError("head_dim and block_k must be powers of two, block_k>=16")
  n_blocks = common.cdiv(K + T, block_k)
  J = splits or (tune["splits"] if block_k == tune["block_k"] else
                 max(1, min(n_blocks, tune["splits"])))
  J = max(1, min(J, n_blocks))
  NBP = common.cdiv(n_blocks, J)
  J = common.cdiv(n_blocks, NBP)  # no empty program
  M = max(16, common.next_pow2(G * T))
  R = T * Hq
  scale = common.default_scale(D, scale)
  direct = J == 1
  kernel = functools.partial(
      _kernel, T=T, G=G, Hq=Hq, M=M, D=D, BK=block_k, NBP=NBP, K=K, S=S,
      scale_log2=scale * common.LOG2E, direct=direct)
  if direct:
    out_shape = [jax.ShapeDtypeStruct((B, R, D), q.dtype)]
  else:
    out_shape = [jax.ShapeDtypeStruct((J, B, R, D), jnp.float32),
                 jax.ShapeDtypeStruct((J, B, R), jnp.float32),
                 jax.ShapeDtypeStruct((J, B, R), jnp.float32)]
  outs = pl.pallas_call(
      kernel,
      grid=(B, Hkv, J),
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=num_warps,
                                         num_stages=num_stages),
      interpret=interpret,
      name="sparse_verify",
  )(lengths.astype(jnp.int32), indices.astype(jnp.int32), q.reshape(B, R, D),
    k, v)
  if direct:
    return outs[0].reshape(B, T, Hq, D)
  o, m, l = outs
  return common.combine_partials(o, m, l, q.dtype).reshape(B, T, Hq, D)
