"""Residual add + RMSNorm of a split-K projection's output, Pallas with
Triton lowering: the partial products summed, added to the residual stream
and normed in one kernel (``kernels.residual_norm.reference`` states the
arithmetic; the kernel does the same operations in the same order).

Grid (cdiv(R, block_rows),) over the R = prod(x.shape[:-1]) rows of the free
views x [R, d], parts [S, R, d].  Program i owns rows i * block_rows ..
i * block_rows + block_rows - 1 and holds each row whole, as one block of
DP = next_pow2(d) columns (d = 896 or 3584 is not a power of two; the lanes
past d and the rows past R are masked, and load as 0, which adds nothing to
a row's sum of squares).  It:
  * loads the x rows and the S partial rows (a static loop over s: the f32
    sum is formed in the reference's order s = 0, 1, ..., S - 1);
  * adds the sum, rounded to x's dtype, to x (one rounding, as XLA's
    ``x + y.astype(x.dtype)``) and stores the new residual rows;
  * takes the mean of squares of those rows in f32, scales them by
    rsqrt(mean + eps), rounds to x's dtype, multiplies by the weight (loaded
    once per program) and stores the normed rows.
With parts=None there is nothing to add: x_new is x itself and the kernel
only norms.  Each row is read and written once; a row never leaves the
program's registers between the sum and the norm, which is what the fusion
buys over XLA's 2-3 kernels at decode sizes (16-80 rows, each a few
microseconds of launch and latency).

Masked stores point their dead lanes past the end of the array (rows >= R,
columns >= d), never at a live element: interpret mode discharges a masked
store as a scatter of old-or-new values, where a duplicate index would race
with the real write (out-of-bounds indices are dropped).

Defaults (one row per program, so 16-80 rows fill 16-80 SMs; 4 warps up to
1024 columns, 8 above) are reasoned, not yet timed on the H200.

Why Triton and not Mosaic GPU: blocks of 1 to a few rows with d not a power
of two and masked tails, no matmul: Triton's masked pointer loads and
stores fit directly; there is nothing here for the tensor cores, and
Mosaic's TMA tiles would need the rows padded to its tile shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common
from kernels.residual_norm.reference import (check_shapes,
                                             residual_norm_reference)


def _kernel(*refs, S, R, d, BR, DP, eps):
  if S:
    x_ref, parts_ref, w_ref, x_out, normed_out = refs
  else:
    x_ref, w_ref, normed_out = refs
  rows = pl.program_id(0) * BR + jnp.arange(BR, dtype=jnp.int32)
  cols = jnp.arange(DP, dtype=jnp.int32)
  col_ok = cols < d
  ok = (rows < R)[:, None] & col_ok[None, :]
  # Rows past R and columns past d are out of bounds: masked loads read
  # nothing there and masked stores drop them (see the module docstring).
  at = (rows[:, None], cols[None, :])
  x = plt.load(x_ref.at[at], mask=ok, other=0.0)
  w = plt.load(w_ref.at[cols], mask=col_ok, other=0.0)
  if S:
    y = plt.load(parts_ref.at[(0,) + at], mask=ok, other=0.0).astype(
        jnp.float32)
    for s in range(1, S):
      y = y + plt.load(parts_ref.at[(s,) + at], mask=ok,
                       other=0.0).astype(jnp.float32)
    x = x + y.astype(x.dtype)
    plt.store(x_out.at[at], x, mask=ok)
  xf = x.astype(jnp.float32)
  # jnp.mean's arithmetic: the sum, then a division by d (masked lanes are 0)
  ms = jnp.sum(xf * xf, axis=1, keepdims=True) / jnp.float32(d)
  xf = xf * lax.rsqrt(ms + eps)
  plt.store(normed_out.at[at], w[None, :] * xf.astype(x.dtype), mask=ok)


def default_tuning(d: int):
  """One row per program; 4 warps up to 1024 columns, 8 above (8-16 f32 of a
  row per thread)."""
  return dict(block_rows=1,
              num_warps=4 if common.next_pow2(d) <= 1024 else 8)


def residual_norm_gpu(x, parts, weight, *, eps, interpret=False, **tuning):
  """(x_new, normed), both [..., d] in x's dtype (``ops.residual_norm``).
  tuning: block_rows (rows per program, a power of two), num_warps."""
  R, d, S = check_shapes(x, parts, weight)
  defaults = default_tuning(d)
  unknown = sorted(tuning.keys() - defaults.keys())
  if unknown:
    raise ValueError(f"unknown tuning {unknown}; known: {sorted(defaults)}")
  tune = defaults | {k: v for k, v in tuning.items() if v is not None}
  BR = int(tune["block_rows"])
  if BR < 1 or BR & (BR - 1):
    raise ValueError(f"block_rows={BR} must be a power of two >= 1")
  if R == 0:  # nothing to launch
    return residual_norm_reference(x, parts, weight, eps=eps)
  kernel = functools.partial(_kernel, S=S, R=R, d=d, BR=BR,
                             DP=common.next_pow2(d), eps=float(eps))
  row_shape = jax.ShapeDtypeStruct((R, d), x.dtype)
  args = [x.reshape(R, d)]
  if S:
    args.append(parts.reshape(S, R, d))
  args.append(weight)
  outs = pl.pallas_call(
      kernel,
      grid=(common.cdiv(R, BR),),
      out_shape=[row_shape, row_shape] if S else [row_shape],
      # one pass, no loop: nothing to pipeline
      compiler_params=plt.CompilerParams(num_warps=int(tune["num_warps"]),
                                         num_stages=1),
      interpret=interpret,
      name="residual_norm",
  )(*args)
  if S:
    x_new, normed = outs
    return x_new.reshape(x.shape), normed.reshape(x.shape)
  return x, outs[0].reshape(x.shape)
