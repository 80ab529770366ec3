"""SRH importance scores, Pallas with Triton lowering (two kernels).

Kernel A, grid (B, nd, J) over the nd *distinct* KV heads of the selected
heads: program (b, d, j) reads key chunk j of KV head kvmap[d] once and
computes the logits of every selected (head, query) row that uses it (rows of
the [B, T*n, D] query view, listed in rowmap[d], padded to a power of two
>= 16).  It writes the raw logits (log2 units) to f32[B, T*n, S] and its
partial (max, sum-exp) per row.  Chunks at or past lengths[b] + T are
skipped.  XLA merges the partials into one log-sum-exp per row.  Kernel B,
grid (B, S / block_s), turns logits into probabilities, masks the causal rule
and invalid queries, and reduces over rows (sum or max) into f32[B, S].

Bytes: nd * S_live * D * itemsize (keys) + 2 * n * T * S_live * 4 (logits
written, read back) + S * 4 (scores).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common, gpu_common


def head_tables(kv_head, T, Mq=None):
  """Distinct KV heads and, per distinct head, its rows of [B, T*n, D]."""
  n = len(kv_head)
  distinct = sorted(set(kv_head))
  rows = [[t * n + i for t in range(T) for i in range(n) if kv_head[i] == hd]
          for hd in distinct]
  if Mq is None:
    Mq = max(16, common.next_pow2(max(len(r) for r in rows)))
  R = T * n
  rowmap = [r + [R] * (Mq - len(r)) for r in rows]
  return distinct, rowmap, Mq


def _logits_kernel(len_ref, kvmap_ref, rowmap_ref, q_ref, k_ref,
                   lg_ref, m_ref, l_ref, *, T, n, Mq, D, BK, chunk, S,
                   scale_log2):
  b = pl.program_id(0)
  d = pl.program_id(1)
  j = pl.program_id(2)
  L = len_ref[b]
  kv_end = jnp.minimum(L + T, S)
  c0 = j * chunk
  R = T * n
  h = kvmap_ref[d]
  rows = rowmap_ref[d, :]
  row_ok = rows < R
  qlim = L + rows // n
  cols = jnp.arange(D, dtype=jnp.int32)

  @pl.when(c0 < kv_end)
  def _():
    q = plt.load(q_ref.at[b, rows[:, None], cols[None, :]],
                 mask=row_ok[:, None], other=0.0)
    c1 = jnp.minimum(c0 + chunk, kv_end)
    n_full = jnp.maximum(jnp.minimum(c1, L + 1) - c0, 0) // BK
    n_tot = pl.cdiv(c1 - c0, BK)

    def step(i, carry, masked):
      m, l = carry
      s0 = c0 + i * BK
      pos = s0 + jnp.arange(BK, dtype=jnp.int32)
      if masked:
        live = pos < kv_end
        k = plt.load(k_ref.at[b, h, pl.ds(s0, BK), :], mask=live[:, None],
                     other=0.0)
      else:
        k = k_ref[b, h, pl.ds(s0, BK), :]
      s = gpu_common.dot(q, k, trans_b=True) * scale_log2  # [Mq, BK]
      st_mask = row_ok[:, None]
      if masked:
        st_mask = st_mask & live[None, :]
      plt.store(lg_ref.at[b, rows[:, None], pos[None, :]], s, mask=st_mask)
      if masked:
        s = jnp.where(pos[None, :] <= qlim[:, None], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      l = l * jnp.exp2(m - m_safe) + jnp.sum(jnp.exp2(s - m_safe[:, None]),
                                             axis=1)
      return m_new, l

    init = (jnp.full((Mq,), -jnp.inf, jnp.float32),
            jnp.zeros((Mq,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False),
                          init)
    m, l = lax.fori_loop(n_full, n_tot, functools.partial(step, masked=True),
                         carry)
    plt.store(m_ref.at[j, b, rows], m, mask=row_ok)
    plt.store(l_ref.at[j, b, rows], l, mask=row_ok)


def _scores_kernel(len_ref, lse_ref, rv_ref, lg_ref, out_ref, *, T, n, Rp,
                   BS, S, reduce):
  b = pl.program_id(0)
  c = pl.program_id(1)
  L = len_ref[b]
  kv_end = jnp.minimum(L + T, S)
  R = T * n
  rr = jnp.arange(Rp, dtype=jnp.int32)
  row_ok = rr < R
  lse = plt.load(lse_ref.at[b, pl.ds(0, Rp)], mask=row_ok, other=0.0)
  rv = plt.load(rv_ref.at[b, pl.ds(0, Rp)], mask=row_ok, other=0)
  p0 = c * BS
  pos = p0 + jnp.arange(BS, dtype=jnp.int32)
  live = pos < kv_end
  x = plt.load(lg_ref.at[b, pl.ds(0, Rp), pl.ds(p0, BS)],
               mask=row_ok[:, None] & live[None, :], other=-jnp.inf)
  allowed = ((row_ok & (rv != 0))[:, None]
             & (pos[None, :] <= (L + rr // n)[:, None]))
  prob = jnp.where(allowed, jnp.exp2(x - lse[:, None]), 0.0)
  if reduce == "sum":
    score = jnp.sum(prob, axis=0)
  else:
    score = jnp.max(prob, axis=0)
  plt.store(out_ref.at[b, pl.ds(p0, BS)], score, mask=pos < S)


def default_tuning(B, nd, S):
  block_k = 64
  target = 4 * common.num_sms()
  splits = max(1, common.cdiv(target, B * nd))
  chunk = max(1024, common.round_up(common.cdiv(S, splits), block_k))
  chunk = min(chunk, common.round_up(S, block_k))
  return dict(block_k=block_k, chunk=chunk, block_s=256, num_warps=4,
              num_stages=3)


def lse_from_partials(m, l, valid):
  """Per-row log2-sum-exp2 from split partials m, l: f32[J, B, R]."""
  vm = valid[:, :, None]
  m = jnp.where(vm, m, -jnp.inf)
  m_max = jnp.max(m, axis=0)
  m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
  tot = jnp.sum(jnp.where(vm, jnp.exp2(m - m_max[None]) * l, 0.0), axis=0)
  return m_max + jnp.log2(tot)


def srh_scores_gpu(q, k, lengths, kv_head, *, q_valid=None, reduce="sum",
                   scale=None, interpret=False, block_k=None, chunk=None,
                   block_s=None, num_warps=None, num_stages=None):
  B, T, n, D = q.shape
  S = k.shape[2]
  distinct, rowmap, Mq = head_tables(kv_head, T)
  nd = len(distinct)
  tune = default_tuning(B, nd, S)
  block_k = block_k or tune["block_k"]
  chunk = chunk or tune["chunk"]
  block_s = block_s or tune["block_s"]
  num_warps = num_warps or tune["num_warps"]
  num_stages = num_stages or tune["num_stages"]
  if chunk % block_k:
    raise ValueError(f"chunk={chunk} must be a multiple of block_k={block_k}")
  J = common.cdiv(S, chunk)
  R = T * n
  Rp = common.next_pow2(R)
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  cp = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)

  lg, m, l = pl.pallas_call(
      functools.partial(_logits_kernel, T=T, n=n, Mq=Mq, D=D, BK=block_k,
                        chunk=chunk, S=S, scale_log2=scale * common.LOG2E),
      grid=(B, nd, J),
      out_shape=[jax.ShapeDtypeStruct((B, R, S), jnp.float32),
                 jax.ShapeDtypeStruct((J, B, R), jnp.float32),
                 jax.ShapeDtypeStruct((J, B, R), jnp.float32)],
      compiler_params=cp,
      interpret=interpret,
      name="srh_logits",
  )(lengths, jnp.asarray(distinct, jnp.int32), jnp.asarray(rowmap, jnp.int32),
    q.reshape(B, R, D), k)
  kv_end = jnp.minimum(lengths + T, S)
  valid = (jnp.arange(J, dtype=jnp.int32)[:, None] * chunk) < kv_end[None, :]
  lse = lse_from_partials(m, l, valid)  # [B, R]
  if q_valid is None:
    rv = jnp.ones((B, R), jnp.int32)
  else:
    rv = jnp.repeat(q_valid.astype(jnp.int32), n, axis=1)  # row t*n + i
  return pl.pallas_call(
      functools.partial(_scores_kernel, T=T, n=n, Rp=Rp, BS=block_s, S=S,
                        reduce=reduce),
      grid=(B, common.cdiv(S, block_s)),
      out_shape=jax.ShapeDtypeStruct((B, S), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="srh_scores",
  )(lengths, lse, rv, lg)
