"""Skinny matmul with fused neighbours, Pallas with Triton lowering.

A small model's decode layer at batch 16 multiplies 16 rows by each weight
matrix: every projection is a weight stream of 1-17 MB, ~0.3-4 us at the
copy bandwidth, and the elementwise work around it (the RMSNorm before it,
the bias, SiLU x up and the residual add after it) moves almost nothing.
Run op by op, that layer-pass is ~11 kernels of 1.4-8 us each: the latency
of launches and of K-split partial sums, not the bytes.  This kernel is one
launch per projection with those neighbours inside it.

Grid (N_out / block_n, splits).  Program (j, s) owns output columns
[j * block_n, (j + 1) * block_n) and the K range of split s; it walks K in
tiles of block_k (a pipelined loop: `num_stages` weight tiles in flight),
each step loading the x tile [MP, block_k] (M rows padded to >= 16 for the
tensor-core dot; x is tiny and stays in L2) and the weight tile(s):
  * RMSNorm prologue: x times the norm weight in x's dtype, the per-row sum
    of squares accumulated alongside; the row scale rsqrt(mean + eps) is
    applied to the f32 accumulator at the end (a row scale commutes with the
    product), so x is read once;
  * glu: the output tile's gate and up columns are 2 * block_n contiguous
    columns of ``w`` (gate, up alternating), one accumulator, split into its
    even and odd columns at the end by exact one-hot f32 dots, silu(gate) *
    up in f32;
  * bias and residual added in f32 before the single rounding to the output
    dtype.
With splits > 1 (no norm, no glu), each split stores its f32 partial product
and the caller sums them with the bias and residual (one XLA fusion): for
projections with too few output columns to fill the GPU (N_out / block_n
programs alone would leave SMs idle).

Why Triton and not Mosaic GPU: 16 rows per tile, and Mosaic GPU's tensor-core
path is WGMMA, whose accumulator needs M a multiple of 64: 3/4 of each tile
would be padding, and the kernel is bound by weight bytes in flight per SM,
which Triton's pipelined pointer loads give directly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common, gpu_common
from kernels.skinny_matmul.reference import check_shapes


def _span(start, size, limit, exact):
  """Indices start .. start + size - 1 and their in-bounds mask (None when
  every index is in bounds: unmasked, unclamped indices keep the contiguity
  Triton vectorises the loads on)."""
  idx = start + jnp.arange(size, dtype=jnp.int32)
  if exact:
    return idx, None
  ok = idx < limit
  return jnp.where(ok, idx, 0), ok


def _tile(ref, rows, row_ok, cols, col_ok, lead=()):
  """ref.at[*lead, rows, cols] as a tile (with its mask, None when
  unmasked)."""
  mask = None
  if row_ok is not None or col_ok is not None:
    mask = jnp.ones((rows.shape[0], cols.shape[0]), jnp.bool_)
    mask = mask if row_ok is None else mask & row_ok[:, None]
    mask = mask if col_ok is None else mask & col_ok[None, :]
  return ref.at[(*lead, rows[:, None], cols[None, :])], mask


def _load(ref_and_mask):
  ref, mask = ref_and_mask
  return plt.load(ref, mask=mask, other=None if mask is None else 0)


def _kernel(*refs, M, MP, K, KS, N_out, BK, BN, glu, has_norm, has_bias,
            has_residual, eps, splits):
  x_ref, w_ref, *extra = refs
  if splits > 1:  # partial products (and row sums of squares): the caller finishes
    out_ref, ss_ref = (extra[-2], extra[-1]) if has_norm else (extra[-1], None)
    extra = extra[:-2] if has_norm else extra[:-1]
  else:
    out_ref, ss_ref = extra.pop(), None
  nw_ref = extra.pop(0) if has_norm else None
  b_ref = extra.pop(0) if has_bias else None
  r_ref = extra.pop(0) if has_residual else None
  j = pl.program_id(0)
  k0 = pl.program_id(1) * KS

  rows, row_ok = _span(0, MP, M, M == MP)
  cols, col_ok = _span(j * BN, BN, N_out, N_out % BN == 0)
  # glu: the gate/up pairs of the output tile are 2 * BN contiguous columns
  # of w (strided 2-byte loads would not be copied asynchronously)
  wcols, wcol_ok = _span(j * BN * 2, BN * 2, 2 * N_out, N_out % BN == 0) if glu else (cols, col_ok)
  k_exact = K == splits * KS  # every K tile full

  def body(i, carry):
    acc, ss = carry
    ks, k_ok = _span(k0 + i * BK, BK, K, k_exact)
    xk = _load(_tile(x_ref, rows, row_ok, ks, k_ok))
    if has_norm:
      xf = xk.astype(jnp.float32)
      ss = ss + jnp.sum(xf * xf, axis=1)
      nw = plt.load(nw_ref.at[ks], mask=k_ok, other=None if k_ok is None else 0)
      xk = xk * nw[None, :]
    acc = acc + gpu_common.dot(xk, _load(_tile(w_ref, ks, k_ok, wcols, wcol_ok)))
    return acc, ss

  init = (jnp.zeros((MP, wcols.shape[0]), jnp.float32), jnp.zeros((MP,), jnp.float32))
  y, ss = lax.fori_loop(0, KS // BK, body, init)
  srows = jnp.arange(MP, dtype=jnp.int32)
  if splits > 1:
    s = pl.program_id(1)
    ref, mask = _tile(out_ref, srows, row_ok, j * wcols.shape[0] + jnp.arange(
        wcols.shape[0], dtype=jnp.int32), wcol_ok, (s,))
    plt.store(ref, y, mask=mask)
    if has_norm:
      @pl.when(j == 0)
      def _():
        plt.store(ss_ref.at[s, srows], ss, mask=row_ok)
    return

  if has_norm:
    y = y * lax.rsqrt(ss / K + eps)[:, None]
  if glu:
    # the even (gate) and odd (up) columns, picked by exact one-hot f32 dots
    c = jnp.arange(2 * BN, dtype=jnp.int32)[:, None]
    o = jnp.arange(BN, dtype=jnp.int32)[None, :]
    gate = gpu_common.dot(y, (c == 2 * o).astype(jnp.float32))
    up = gpu_common.dot(y, (c == 2 * o + 1).astype(jnp.float32))
    y = gate / (1.0 + jnp.exp(-gate)) * up
  if has_bias:
    bias = plt.load(b_ref.at[cols], mask=col_ok, other=None if col_ok is None else 0)
    y = y + bias.astype(jnp.float32)[None, :]
  if has_residual:
    y = y + _load(_tile(r_ref, rows, row_ok, cols, col_ok)).astype(jnp.float32)
  # masked rows and columns point past the end, never at a live element:
  # interpret mode discharges a masked store as a scatter, where a duplicate
  # index would race with the real write (out-of-bounds ones are dropped)
  scols = j * BN + jnp.arange(BN, dtype=jnp.int32)
  ref, mask = _tile(out_ref, srows, row_ok, scols, col_ok)
  plt.store(ref, y.astype(out_ref.dtype), mask=mask)


def default_tuning(M, K, N, glu):
  """Tiles for M <= 64 rows: enough programs to cover the SMs, K tiles of
  128-256 rows, 4 weight tiles in flight."""
  n_out = N // 2 if glu else N
  block_k = 256 if K % 256 == 0 else 128
  block_n = 32 if n_out // 32 >= common.num_sms() else 16
  splits = 1
  programs = common.cdiv(n_out, block_n)
  while programs * splits * 2 <= 2 * common.num_sms() and K >= block_k * splits * 2:
    splits *= 2
  return dict(block_n=block_n, block_k=block_k, splits=splits, num_warps=4, num_stages=4)


def skinny_matmul_gpu(x, w, *, norm_weight=None, eps=1e-6, bias=None, glu=False,
                      residual=None, interpret=False, block_n=None, block_k=None,
                      splits=None, num_warps=None, num_stages=None):
  M, K, N, n_out = check_shapes(x, w, norm_weight, bias, glu, residual)
  tune = default_tuning(M, K, N, glu)
  block_n = block_n or tune["block_n"]
  block_k = block_k or tune["block_k"]
  splits = splits or tune["splits"]
  num_warps = num_warps or tune["num_warps"]
  num_stages = num_stages or tune["num_stages"]
  for name, v in (("block_n", block_n), ("block_k", block_k)):
    if v & (v - 1) or v < 16:
      raise ValueError(f"{name}={v} must be a power of two >= 16")
  MP = max(16, common.next_pow2(M))
  KS = common.round_up(common.cdiv(K, splits), block_k)
  has_norm = norm_weight is not None
  final = splits == 1
  kernel = functools.partial(
      _kernel, M=M, MP=MP, K=K, KS=KS, N_out=n_out, BK=block_k, BN=block_n, glu=glu,
      has_norm=has_norm, has_bias=bias is not None and final,
      has_residual=residual is not None and final, eps=float(eps), splits=splits)
  operands = [x, w] + ([norm_weight.astype(x.dtype)] if has_norm else [])
  if final:
    operands += [a for a in (bias, residual) if a is not None]
    out_shape = jax.ShapeDtypeStruct((M, n_out), x.dtype)
  else:
    out_shape = [jax.ShapeDtypeStruct((splits, M, N), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct((splits, M), jnp.float32)] if has_norm else []
  out = pl.pallas_call(
      kernel,
      grid=(common.cdiv(n_out, block_n), splits),
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="skinny_matmul",
  )(*operands)
  if final:
    return out
  # the K splits' partial products, finished in one XLA fusion
  y = jnp.sum(out[0], axis=0)
  if has_norm:
    y = y * jax.lax.rsqrt(jnp.sum(out[1], axis=0) / K + eps)[:, None]
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  if glu:
    pairs = y.reshape(M, n_out, 2)
    y = jax.nn.silu(pairs[..., 0]) * pairs[..., 1]
  if residual is not None:
    y = y + residual.astype(jnp.float32)
  return y.astype(x.dtype)
