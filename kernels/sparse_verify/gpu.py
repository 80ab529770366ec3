"""Sparse verify attention, Pallas with Triton lowering (row gather).

Grid (B, Hkv, J).  The list a sequence attends to is the K indices followed by
the T block rows lengths[b] .. lengths[b] + T - 1; the kernel builds that list
on the fly (no XLA pre-pass) and program (b, h, j) walks its share of it in
blocks of ``block_k`` entries: one masked row gather of K and of V per block
([block_k, D], each row contiguous), shared by the G heads x T queries packed
as the M rows of the tile (row r = t * G + g).  Queries are read from, and the
output written to, the natural [B, T, Hq, D] layout by row gather/scatter.

Split-K merge (J > 1), picked by ``combine``:
  "xla" (default): partials merged by :func:`kernels.common.combine_partials`
    (a few small XLA fusions after the kernel).
  "fused" (not the default: in the end-to-end step no faster than "xla",
    see kernels/NOTES.md; equal to the reference in interpret mode and on
    an H200):
    every program writes its f32 partial (o, m, l), then bumps a per-(b, h)
    counter (acq_rel atomic after a CTA barrier); the program that arrives
    last merges the J partials (fresh in L2) and writes the output.  One
    kernel (+ a tiny memset of the counters).
With J == 1 the program normalises and writes the output itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common, gpu_common


def _kernel(len_ref, idx_ref, q_ref, k_ref, v_ref, *refs, T, G, Hq, Hkv, M, D,
            BK, NBP, J, K, S, scale_log2, mode, interpret):
  b = pl.program_id(0)
  h = pl.program_id(1)
  j = pl.program_id(2)
  L = len_ref[b]

  t_r, row_ok, qrow = gpu_common.packed_rows(M, G, T, Hq, h)
  cols = jnp.arange(D, dtype=jnp.int32)
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
    s = gpu_common.dot(q, k, trans_b=True) * scale_log2
    allowed = valid[None, :] & (pos[None, :] <= qlim[:, None])
    s = jnp.where(allowed, s, -jnp.inf)
    return gpu_common.softmax_update(o, m, l, s, v)

  init = gpu_common.softmax_init(M, D)
  o, m, l = lax.fori_loop(0, NBP, step, init)
  if mode == "direct":
    (out_ref,) = refs
    out = (o / l[:, None]).astype(out_ref.dtype)
    plt.store(out_ref.at[b, qrow[:, None], cols[None, :]], out,
              mask=row_ok[:, None])
    return
  if mode == "fused":
    _, out_ref, o_ref, m_ref, l_ref, _ = refs
  else:
    o_ref, m_ref, l_ref = refs
  plt.store(o_ref.at[j, b, qrow[:, None], cols[None, :]], o,
            mask=row_ok[:, None])
  plt.store(m_ref.at[j, b, qrow], m, mask=row_ok)
  plt.store(l_ref.at[j, b, qrow], l, mask=row_ok)
  if mode != "fused":
    return
  cnt_ref = refs[-1]  # aliased to the zeroed counters input
  if not interpret:  # every thread's partial stores precede the release
    plt.debug_barrier()
  arrived = plt.atomic_add(cnt_ref, (b * Hkv + h,), jnp.int32(1))

  @pl.when(arrived == J - 1)
  def _():
    ms = [plt.load(m_ref.at[jj, b, qrow], mask=row_ok, other=-jnp.inf)
          for jj in range(J)]
    m_max = functools.reduce(jnp.maximum, ms)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    acc = jnp.zeros((M, D), jnp.float32)
    tot = jnp.zeros((M,), jnp.float32)
    for jj in range(J):
      w = jnp.exp2(ms[jj] - m_max)
      # Plain loads: only this program ever reads these partials, so no
      # stale L1 line can exist.  (jax's Triton lowering rejects ".cg":
      # it checks for ".cg" but its table is keyed "cg".)
      lj = plt.load(l_ref.at[jj, b, qrow], mask=row_ok, other=0.0)
      oj = plt.load(o_ref.at[jj, b, qrow[:, None], cols[None, :]],
                    mask=row_ok[:, None], other=0.0)
      acc = acc + w[:, None] * oj
      tot = tot + w * lj
    tot = jnp.where(row_ok, tot, 1.0)
    plt.store(out_ref.at[b, qrow[:, None], cols[None, :]],
              (acc / tot[:, None]).astype(out_ref.dtype),
              mask=row_ok[:, None])


def default_tuning(B, Hkv, K, T):
  """Best measured on the H200 (kernels/NOTES.md): ~2 programs per SM
  (J = round(target_programs / (B * Hkv)) splits), XLA merge."""
  return dict(block_k=64, target_programs=2 * common.num_sms(), num_warps=4,
              num_stages=3, combine="xla")


def sparse_verify_gpu(q, k, v, lengths, indices, *, scale=None,
                      interpret=False, block_k=None, splits=None,
                      target_programs=None, num_warps=None, num_stages=None,
                      combine=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  if indices.ndim != 2 or indices.shape[0] != B:
    raise ValueError(f"indices must be int32[B, K], got {indices.shape}")
  K = indices.shape[1]
  G = Hq // Hkv
  tune = default_tuning(B, Hkv, K, T)
  block_k = block_k or tune["block_k"]
  num_warps = num_warps or tune["num_warps"]
  num_stages = num_stages or tune["num_stages"]
  combine = combine or tune["combine"]
  if combine not in ("fused", "xla"):
    raise ValueError(f"combine must be 'fused' or 'xla', got {combine!r}")
  if D & (D - 1) or block_k & (block_k - 1) or block_k < 16:
    raise ValueError("head_dim and block_k must be powers of two, block_k>=16")
  n_blocks = common.cdiv(K + T, block_k)
  if splits is None:
    target = target_programs or tune["target_programs"]
    splits = round(target / (B * Hkv))
  J = max(1, min(int(splits), n_blocks))
  NBP = common.cdiv(n_blocks, J)
  J = common.cdiv(n_blocks, NBP)  # no empty program
  M = max(16, common.next_pow2(G * T))
  R = T * Hq
  scale = common.default_scale(D, scale)
  mode = "direct" if J == 1 else combine
  kernel = functools.partial(
      _kernel, T=T, G=G, Hq=Hq, Hkv=Hkv, M=M, D=D, BK=block_k, NBP=NBP, J=J,
      K=K, S=S, scale_log2=scale * common.LOG2E, mode=mode,
      interpret=bool(interpret))
  partials = [jax.ShapeDtypeStruct((J, B, R, D), jnp.float32),
              jax.ShapeDtypeStruct((J, B, R), jnp.float32),
              jax.ShapeDtypeStruct((J, B, R), jnp.float32)]
  args = [lengths.astype(jnp.int32), indices.astype(jnp.int32),
          q.reshape(B, R, D), k, v]
  aliases = {}
  if mode == "direct":
    out_shape = [jax.ShapeDtypeStruct((B, R, D), q.dtype)]
  elif mode == "fused":
    out_shape = ([jax.ShapeDtypeStruct((B, R, D), q.dtype)] + partials
                 + [jax.ShapeDtypeStruct((B * Hkv,), jnp.int32)])
    args.append(jnp.zeros((B * Hkv,), jnp.int32))  # arrival counters
    aliases = {5: 4}
  else:
    out_shape = partials
  outs = pl.pallas_call(
      kernel,
      grid=(B, Hkv, J),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plt.CompilerParams(num_warps=num_warps,
                                         num_stages=num_stages),
      interpret=interpret,
      name="sparse_verify",
  )(*args)
  if mode in ("direct", "fused"):
    return outs[0].reshape(B, T, Hq, D)
  o, m, l = outs
  return common.combine_partials(o, m, l, q.dtype).reshape(B, T, Hq, D)
