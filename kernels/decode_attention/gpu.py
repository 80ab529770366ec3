"""Full-cache verify attention, Pallas with Triton lowering (split-K).

Grid (B, Hkv, J): program (b, h, j) owns key chunk j (``chunk`` rows) of KV
head h of sequence b.  The G query heads of that KV head times the T verify
tokens are the M rows of one tile (row r = t * G + g, padded to a power of two
>= 16 for the tensor-core dots), so every K/V row is read once per (b, h).
Chunks at or past lengths[b] + T are skipped (no loads, no stores).  Inside a
chunk, blocks fully visible to every query run without masks; only the last
block(s) (crossing position lengths[b]) use masked loads and the causal mask.
Partials (o, m, l) go to f32[J, B, T*Hq, ...] in the natural row order and are
merged by :func:`kernels.common.combine_partials` (one XLA fusion).  With one
chunk (J == 1) the kernel normalises and writes the output itself.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common, gpu_common


def _kernel(len_ref, q_ref, k_ref, v_ref, *out_refs, T, G, Hq, M, D, BK,
            chunk, S, scale_log2, direct):
  b = pl.program_id(0)
  h = pl.program_id(1)
  j = pl.program_id(2)
  L = len_ref[b]
  kv_end = jnp.minimum(L + T, S)
  c0 = j * chunk

  t_r, row_ok, qrow = gpu_common.packed_rows(M, G, T, Hq, h)
  cols = jnp.arange(D, dtype=jnp.int32)
  qlim = L + t_r  # last key position row r may see

  @pl.when(c0 < kv_end)
  def _():
    q = plt.load(q_ref.at[b, qrow[:, None], cols[None, :]],
                 mask=row_ok[:, None], other=0.0)
    c1 = jnp.minimum(c0 + chunk, kv_end)
    # Positions < L + 1 are visible to every query row: no mask needed.
    n_full = jnp.maximum(jnp.minimum(c1, L + 1) - c0, 0) // BK
    n_tot = pl.cdiv(c1 - c0, BK)

    def step(i, carry, masked):
      o, m, l = carry
      s0 = c0 + i * BK
      if masked:
        pos = s0 + jnp.arange(BK, dtype=jnp.int32)
        live = (pos < kv_end)[:, None]
        k = plt.load(k_ref.at[b, h, pl.ds(s0, BK), :], mask=live, other=0.0)
        v = plt.load(v_ref.at[b, h, pl.ds(s0, BK), :], mask=live, other=0.0)
      else:
        k = k_ref[b, h, pl.ds(s0, BK), :]
        v = v_ref[b, h, pl.ds(s0, BK), :]
      s = gpu_common.dot(q, k, trans_b=True) * scale_log2  # [M, BK] f32, log2 units
      if masked:
        s = jnp.where(pos[None, :] <= qlim[:, None], s, -jnp.inf)
      # masked blocks: a row may have seen no key yet
      return gpu_common.softmax_update(o, m, l, s, v, guard_empty=masked)

    init = gpu_common.softmax_init(M, D)
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False),
                          init)
    o, m, l = lax.fori_loop(n_full, n_tot, functools.partial(step, masked=True),
                            carry)
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


def default_tuning(B, Hkv, S, T, G, D, dtype):
  """Chunk / block sizes picked on the H200 (see kernels/NOTES.md)."""
  block_k = 64
  # About 4 programs per SM over the whole cache (rounded to a power of two,
  # 1k..8k rows: longer chunks keep the f32 partials a few % of the K/V
  # bytes; at 7B 16x32k 4096-8192 measured best).
  want = S * B * Hkv / (4 * common.num_sms())
  chunk = 2 ** round(math.log2(max(want, 1.0)))
  chunk = min(max(chunk, 1024), 8192, common.round_up(S, block_k))
  chunk = common.round_up(chunk, block_k)
  return dict(block_k=block_k, chunk=chunk, num_warps=4, num_stages=3)


def decode_attention_gpu(q, k, v, lengths, *, scale=None, interpret=False,
                         block_k=None, chunk=None, num_warps=None,
                         num_stages=None):
  B, T, Hq, D, Hkv, S = common.check_attention_shapes(q, k, v)
  G = Hq // Hkv
  tune = default_tuning(B, Hkv, S, T, G, D, k.dtype)
  block_k = block_k or tune["block_k"]
  chunk = chunk or tune["chunk"]
  num_warps = num_warps or tune["num_warps"]
  num_stages = num_stages or tune["num_stages"]
  if chunk % block_k:
    raise ValueError(f"chunk={chunk} must be a multiple of block_k={block_k}")
  if D & (D - 1) or block_k & (block_k - 1):
    raise ValueError("head_dim and block_k must be powers of two (Triton)")
  J = common.cdiv(S, chunk)
  M = max(16, common.next_pow2(G * T))
  R = T * Hq
  scale = common.default_scale(D, scale)
  lengths = lengths.astype(jnp.int32)
  q2 = q.reshape(B, R, D)
  direct = J == 1
  kernel = functools.partial(
      _kernel, T=T, G=G, Hq=Hq, M=M, D=D, BK=block_k, chunk=chunk, S=S,
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
      name="decode_attention",
  )(lengths, q2, k, v)
  if direct:
    return outs[0].reshape(B, T, Hq, D)
  o, m, l = outs
  kv_end = jnp.minimum(lengths + T, S)
  valid = (jnp.arange(J, dtype=jnp.int32)[:, None] * chunk) < kv_end[None, :]
  out = common.combine_partials(o, m, l, q.dtype, valid=valid)
  return out.reshape(B, T, Hq, D)
