"""Full-cache verify attention, Pallas TPU (split-K, scalar-prefetched lengths).

Grid (B, Hkv, J, NB): chunk j of KV head h of sequence b is walked in NB
blocks of ``block_k`` rows by the auto-pipeline.  lengths is scalar-prefetched
into SMEM and the K/V index maps clamp the block index to the last live block,
so blocks past lengths[b] + T repeat the previous index and are not fetched
again (no HBM traffic) and their compute is skipped.  Queries of one KV head
are packed as M rows (r = t * G + g, padded to a multiple of 8).  Partials are
merged in XLA by :func:`kernels.common.combine_partials`.

Not run on TPU hardware in this project's CI: tested in TPU interpret mode.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import common, tpu_common


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
            acc_sc, m_sc, l_sc, *, T, G, M, BK, NB, S, scale_log2):
  b = pl.program_id(0)
  j = pl.program_id(2)
  i = pl.program_id(3)
  L = len_ref[b]
  kv_end = jnp.minimum(L + T, S)
  start = (j * NB + i) * BK

  @pl.when(i == 0)
  def _():
    acc_sc[...] = jnp.zeros_like(acc_sc)
    m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
    l_sc[...] = jnp.zeros_like(l_sc)

  @pl.when(start < kv_end)
  def _():
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale_log2
    pos = start + lax.broadcasted_iota(jnp.int32, (M, BK), 1)
    t_r = lax.broadcasted_iota(jnp.int32, (M, BK), 0) // G
    s = jnp.where(pos <= L + t_r, s, -jnp.inf)
    live = (start + lax.broadcasted_iota(jnp.int32, (BK, 1), 0)) < kv_end
    v = jnp.where(live, v, jnp.zeros_like(v))  # stale slots may be NaN
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe)
    l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = acc_sc[...] * alpha + lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    m_sc[...] = m_new

  @pl.when(i == NB - 1)
  def _():
    o_ref[...] = acc_sc[...]
    m_ref[...] = m_sc[...]
    l_ref[...] = l_sc[...]


def decode_attention_tpu(q, k, v, lengths, *, scale=None, interpret=False,
                         block_k=None, chunk=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  G = Hq // Hkv
  block_k = block_k or min(512, common.round_up(S, 16))
  if S % block_k:
    raise ValueError(f"S={S} must be a multiple of block_k={block_k} on TPU")
  chunk = chunk or max(block_k, common.round_up(common.cdiv(S, 4), block_k))
  if chunk % block_k:
    raise ValueError(f"chunk={chunk} must be a multiple of block_k={block_k}")
  NB = chunk // block_k
  J = common.cdiv(S, chunk)
  n_blocks = S // block_k
  M = common.round_up(G * T, 8)
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  qp = tpu_common.pack_queries(q, Hkv, M)

  def kv_map(b, h, j, i, len_ref):
    last = (jnp.minimum(len_ref[b] + T, S) - 1) // block_k
    blk = jnp.minimum(jnp.minimum(j * NB + i, last), n_blocks - 1)
    return (b, h, blk, 0)

  out_specs, out_shape = tpu_common.partial_outputs(
      J, B, Hkv, M, D, lambda b, h, j, i, L: (j, b, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, Hkv, J, NB),
      in_specs=[
          pl.BlockSpec((None, None, M, D), lambda b, h, j, i, L: (b, h, 0, 0)),
          pl.BlockSpec((None, None, block_k, D), kv_map),
          pl.BlockSpec((None, None, block_k, D), kv_map),
      ],
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((M, D), jnp.float32),
                      pltpu.VMEM((M, 1), jnp.float32),
                      pltpu.VMEM((M, 1), jnp.float32)],
  )
  kernel = functools.partial(_kernel, T=T, G=G, M=M, BK=block_k, NB=NB, S=S,
                             scale_log2=scale * common.LOG2E)
  o, m, l = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel",
                               "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="decode_attention_tpu",
  )(lengths, qp, k, v)
  return tpu_common.merge_partials(o, m, l, T, G, q.dtype)
