"""Sparse verify attention, Pallas TPU (scalar-prefetched indices, DMA gather).

The extended list (the K indices, then the T block rows; invalid entries -1)
is built in XLA and scalar-prefetched into SMEM with lengths.  Grid
(B, Hkv, J): program (b, h, j) walks NBP blocks of ``block_k`` entries; for
each block it issues one row DMA per entry from the HBM cache into a VMEM
slot (K and V), double-buffered: block i+1's copies are in flight while block
i is computed.  Padding entries copy row 0 (live) and are masked.  The same
list is also passed as a VMEM block to build the lane-vector masks.  Partials
are merged in XLA by :func:`kernels.common.combine_partials`.

Not run on TPU hardware in this project's CI: tested in TPU interpret mode.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import common, tpu_common
from kernels.sparse_verify.reference import extended_positions


def _kernel(len_ref, idx_sref, q_ref, idx_vref, k_hbm, v_hbm,
            o_ref, m_ref, l_ref, kbuf, vbuf, sem, *, T, G, M, BK, NBP,
            scale_log2):
  b = pl.program_id(0)
  h = pl.program_id(1)
  j = pl.program_id(2)
  L = len_ref[b]
  base = j * (NBP * BK)

  def row_copies(blk, slot, fn):
    def body(r, c):
      p = jnp.maximum(idx_sref[b, base + blk * BK + r], 0)
      for src, dst, s in ((k_hbm, kbuf, 0), (v_hbm, vbuf, 1)):
        fn(pltpu.make_async_copy(src.at[b, h, pl.ds(p, 1), :],
                                 dst.at[slot, pl.ds(r, 1), :],
                                 sem.at[s, slot]))
      return c
    lax.fori_loop(0, BK, body, 0)

  start = lambda c: c.start()
  wait = lambda c: c.wait()
  row_copies(0, 0, start)

  q = q_ref[...]
  t_r = lax.broadcasted_iota(jnp.int32, (M, BK), 0) // G

  def step(i, carry):
    o, m, l = carry
    slot = i % 2

    @pl.when(i + 1 < NBP)
    def _():
      row_copies(i + 1, 1 - slot, start)

    row_copies(i, slot, wait)
    pos = idx_vref[:, pl.ds(i * BK, BK)]  # [1, BK]
    k = kbuf[slot]
    v = vbuf[slot]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale_log2
    allowed = (pos >= 0) & (pos <= L + t_r)
    s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe)
    l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
    o = o * alpha + lax.dot_general(p.astype(v.dtype), v,
                                    (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    return o, m_new, l

  D = q.shape[1]
  init = (jnp.zeros((M, D), jnp.float32),
          jnp.full((M, 1), -jnp.inf, jnp.float32),
          jnp.zeros((M, 1), jnp.float32))
  o, m, l = lax.fori_loop(0, NBP, step, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def sparse_verify_tpu(q, k, v, lengths, indices, *, scale=None,
                      interpret=False, block_k=None, splits=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  K = indices.shape[1]
  G = Hq // Hkv
  block_k = block_k or 128
  n_blocks = common.cdiv(K + T, block_k)
  J = max(1, min(splits or 1, n_blocks))
  NBP = common.cdiv(n_blocks, J)
  J = common.cdiv(n_blocks, NBP)
  N = J * NBP * block_k
  M = common.round_up(G * T, 8)
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  pos, valid = extended_positions(indices, lengths, T)
  pos = jnp.where(valid & (pos < S), pos, -1)
  pos = jnp.pad(pos, ((0, 0), (0, N - (K + T))), constant_values=-1)
  qp = tpu_common.pack_queries(q, Hkv, M)

  out_specs, out_shape = tpu_common.partial_outputs(
      J, B, Hkv, M, D, lambda b, h, j, L, I: (j, b, h, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(B, Hkv, J),
      in_specs=[
          pl.BlockSpec((None, None, M, D), lambda b, h, j, L, I: (b, h, 0, 0)),
          pl.BlockSpec((None, 1, NBP * block_k),
                       lambda b, h, j, L, I: (b, 0, j)),
          pl.BlockSpec(memory_space=pl.ANY),
          pl.BlockSpec(memory_space=pl.ANY),
      ],
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((2, block_k, D), k.dtype),
                      pltpu.VMEM((2, block_k, D), v.dtype),
                      pltpu.SemaphoreType.DMA((2, 2))],
  )
  kernel = functools.partial(_kernel, T=T, G=G, M=M, BK=block_k, NBP=NBP,
                             scale_log2=scale * common.LOG2E)
  o, m, l = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="sparse_verify_tpu",
  )(lengths, pos, qp, pos[:, None, :], k, v)
  return tpu_common.merge_partials(o, m, l, T, G, q.dtype)
