"""SRH importance scores, Pallas TPU (scalar-prefetched lengths / KV heads).

Kernel A, grid (B, nd, NB): for distinct KV head d the selected query rows
that read it are packed (in XLA) as Mq rows; each step reads one key block of
KV head kvmap[d] (scalar-prefetched, used in the index map), writes the raw
logits block and folds it into a running (max, sum-exp) per row.  Blocks past
lengths[b] + T are clamped to the last live block: no new fetch, no compute,
no write-back.  Kernel B, grid (B, S / block_s), turns logits into masked
probabilities and reduces them over rows.

Not run on TPU hardware in this project's CI: tested in TPU interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import common
from kernels.srh_scores.gpu import head_tables


def _logits_kernel(len_ref, kvmap_ref, q_ref, k_ref, tm_ref, lg_ref, m_ref,
                   l_ref, m_sc, l_sc, *, T, BK, NB, S, scale_log2):
  b = pl.program_id(0)
  i = pl.program_id(2)
  L = len_ref[b]
  kv_end = jnp.minimum(L + T, S)
  start = i * BK

  @pl.when(i == 0)
  def _():
    m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
    l_sc[...] = jnp.zeros_like(l_sc)

  @pl.when(start < kv_end)
  def _():
    s = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale_log2
    lg_ref[...] = s
    Mq = s.shape[0]
    pos = start + lax.broadcasted_iota(jnp.int32, (Mq, BK), 1)
    s = jnp.where(pos <= L + tm_ref[...], s, -jnp.inf)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l_sc[...] = (l_sc[...] * jnp.exp2(m_prev - m_safe)
                 + jnp.sum(jnp.exp2(s - m_safe), axis=1, keepdims=True))
    m_sc[...] = m_new

  @pl.when(i == NB - 1)
  def _():
    m_ref[...] = m_sc[...]
    l_ref[...] = l_sc[...]


def _scores_kernel(len_ref, lg_ref, lse_ref, rv_ref, tm_ref, out_ref, *, T,
                   BS, reduce):
  b = pl.program_id(0)
  c = pl.program_id(1)
  L = len_ref[b]
  x = lg_ref[...]  # [nd, Mq, BS]
  pos = c * BS + lax.broadcasted_iota(jnp.int32, x.shape, 2)
  allowed = (rv_ref[...] > 0) & (pos <= L + tm_ref[...])
  prob = jnp.where(allowed, jnp.exp2(x - lse_ref[...]), 0.0)
  if reduce == "sum":
    score = jnp.sum(jnp.sum(prob, axis=0), axis=0, keepdims=True)
  else:
    score = jnp.max(jnp.max(prob, axis=0), axis=0, keepdims=True)
  out_ref[...] = score


def srh_scores_tpu(q, k, lengths, kv_head, *, q_valid=None, reduce="sum",
                   scale=None, interpret=False, block_k=None, block_s=None):
  B, T, n, D = q.shape
  S = k.shape[2]
  R = T * n
  distinct, rowmap, _ = head_tables(kv_head, T)
  Mq = common.round_up(max(sum(r < R for r in rm) for rm in rowmap), 8)
  distinct, rowmap, Mq = head_tables(kv_head, T, Mq)
  nd = len(distinct)
  block_k = block_k or min(512, S)
  block_s = block_s or min(2048, S)
  if S % block_k or S % block_s:
    raise ValueError(f"S={S} must be a multiple of block_k and block_s")
  NB = S // block_k
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  rowmap = jnp.asarray(rowmap, jnp.int32)  # [nd, Mq], R = padding
  q2 = jnp.pad(q.reshape(B, R, D), ((0, 0), (0, 1), (0, 0)))
  qp = q2[:, rowmap]  # [B, nd, Mq, D]
  tmap = (rowmap // n)[..., None]  # [nd, Mq, 1]
  interp = pltpu.InterpretParams() if interpret else False

  def k_map(b, d, i, len_ref, kv_ref):
    last = (jnp.minimum(len_ref[b] + T, S) - 1) // block_k
    return (b, kv_ref[d], jnp.minimum(i, last), 0)

  def lg_map(b, d, i, len_ref, kv_ref):
    last = (jnp.minimum(len_ref[b] + T, S) - 1) // block_k
    return (b, d, 0, jnp.minimum(i, last))

  lg, m, l = pl.pallas_call(
      functools.partial(_logits_kernel, T=T, BK=block_k, NB=NB, S=S,
                        scale_log2=scale * common.LOG2E),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(B, nd, NB),
          in_specs=[
              pl.BlockSpec((None, None, Mq, D), lambda b, d, i, L, H: (b, d, 0, 0)),
              pl.BlockSpec((None, None, block_k, D), k_map),
              pl.BlockSpec((None, Mq, 1), lambda b, d, i, L, H: (d, 0, 0)),
          ],
          out_specs=[
              pl.BlockSpec((None, None, Mq, block_k), lg_map),
              pl.BlockSpec((None, None, Mq, 1), lambda b, d, i, L, H: (b, d, 0, 0)),
              pl.BlockSpec((None, None, Mq, 1), lambda b, d, i, L, H: (b, d, 0, 0)),
          ],
          scratch_shapes=[pltpu.VMEM((Mq, 1), jnp.float32),
                          pltpu.VMEM((Mq, 1), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((B, nd, Mq, S), jnp.float32),
                 jax.ShapeDtypeStruct((B, nd, Mq, 1), jnp.float32),
                 jax.ShapeDtypeStruct((B, nd, Mq, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interp,
      name="srh_logits_tpu",
  )(lengths, jnp.asarray(distinct, jnp.int32), qp, k, tmap)
  lse = m + jnp.log2(l)  # every real row sees position 0
  if q_valid is None:
    rv = jnp.ones((B, T), jnp.float32)
  else:
    rv = q_valid.astype(jnp.float32)
  rv = jnp.pad(jnp.repeat(rv, n, axis=1), ((0, 0), (0, 1)))[:, rowmap]
  rv = rv[..., None]  # [B, nd, Mq, 1]; padding rows are 0
  lse = jnp.where(rv > 0, lse, 0.0)
  scores = pl.pallas_call(
      functools.partial(_scores_kernel, T=T, BS=block_s, reduce=reduce),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(B, S // block_s),
          in_specs=[
              pl.BlockSpec((None, nd, Mq, block_s), lambda b, c, L: (b, 0, 0, c)),
              pl.BlockSpec((None, nd, Mq, 1), lambda b, c, L: (b, 0, 0, 0)),
              pl.BlockSpec((None, nd, Mq, 1), lambda b, c, L: (b, 0, 0, 0)),
              pl.BlockSpec((nd, Mq, 1), lambda b, c, L: (0, 0, 0)),
          ],
          out_specs=pl.BlockSpec((None, 1, block_s), lambda b, c, L: (b, 0, c))),
      out_shape=jax.ShapeDtypeStruct((B, 1, S), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel")),
      interpret=interp,
      name="srh_scores_tpu",
  )(lengths, lg, lse, rv, tmap)
  return scores[:, 0]
