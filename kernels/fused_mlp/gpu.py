"""Pallas (Triton lowering) kernel of ``fused_mlp``.

Grid (splits,): program p owns the slice [p Fc, (p + 1) Fc) of the
intermediate dimension (Fc = F / splits), which in the pairs layout is the
contiguous gate/up column block [2 p Fc, 2 (p + 1) Fc):
  1. gu = x @ w_gate_up[:, block], D in tiles of ``block_k`` rows (the
     tile loads pipelined ``num_stages`` deep), f32 accumulation, rounded to
     x's dtype as the model rounds its projection;
  2. gate and up taken apart by two products with 0/1 selection matrices
     (exact: one nonzero term per output, f32 accumulation), h = SiLU(gate)
     x up in f32, rounded to x's dtype;
  3. the partial down product h @ w_down[slice] [M, D] in output tiles of
     ``block_d`` columns, stored as f32 into partial p.
Each program reads its 3 x D x Fc weight elements once. The M rows (16 at a
batch-16 draft pass) are padded to 16, the smallest tensor-core tile.

Why Triton and not Mosaic GPU: the row operand of Hopper's WGMMA is 64 rows,
4x the draft's 16, and a Mosaic GPU projection of 16 rows measured slower
than XLA's (`kernels/NOTES.md`, skinny_matmul); Triton's 16-row dots fit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common
from kernels.gpu_common import dot


def _kernel(x_ref, wgu_ref, wd_ref, out_ref, *, D, Fc, BK, BD):
  p = pl.program_id(0)
  cols = pl.ds(p * 2 * Fc, 2 * Fc)

  def gate_up_step(i, acc):
    ks = pl.ds(i * BK, BK)
    return acc + dot(x_ref[:, ks], wgu_ref[ks, cols])

  m = x_ref.shape[0]
  gu = lax.fori_loop(0, D // BK, gate_up_step, jnp.zeros((m, 2 * Fc), jnp.float32))
  gu = gu.astype(x_ref.dtype)
  rows = jnp.arange(2 * Fc, dtype=jnp.int32)[:, None]
  pair = 2 * jnp.arange(Fc, dtype=jnp.int32)[None, :]
  gate = dot(gu, (rows == pair).astype(gu.dtype))
  up = dot(gu, (rows == pair + 1).astype(gu.dtype))
  # SiLU(gate) x up rounded op by op as jax.nn.silu (gate x sigmoid(gate))
  # and the product round them in x's dtype
  rnd = lambda v: v.astype(x_ref.dtype).astype(jnp.float32)
  sigmoid = rnd(1.0 / (1.0 + jnp.exp(-gate)))
  h = (rnd(gate * sigmoid) * up).astype(x_ref.dtype)  # [M, Fc]

  def down_step(j, carry):
    ds = pl.ds(j * BD, BD)
    out_ref[p, :, ds] = dot(h, wd_ref[pl.ds(p * Fc, Fc), ds])
    return carry

  lax.fori_loop(0, D // BD, down_step, 0)


def default_tuning(d: int, f: int) -> dict:
  """The widest slice of F (a power of two, 16-128 columns) that gives at
  least half the SMs a program (76 programs of 64 columns at the 0.5B
  draft's F = 4864: faster than 152 of 32 or 304 of 16 on an H200), D tiles
  of up to 128 rows and columns, 4 warps, 3 stages."""
  fc = 128
  while fc > 16 and (f % fc or 2 * (f // fc) < common.num_sms()):
    fc //= 2
  block = 128
  while block > 16 and d % block:
    block //= 2
  return dict(splits=max(1, f // fc), block_k=block, block_d=block, num_warps=4, num_stages=3)


@functools.partial(jax.jit, static_argnames=("splits", "block_k", "block_d", "num_warps",
                                             "num_stages", "interpret"))
def fused_mlp_gpu(x, w_gate_up, w_down, *, splits, block_k, block_d, num_warps, num_stages,
                  interpret=False):
  m, d = x.shape
  f = w_down.shape[0]
  fc = f // splits
  rows = max(16, common.next_pow2(m))
  kernel = functools.partial(_kernel, D=d, Fc=fc, BK=block_k, BD=block_d)
  out = pl.pallas_call(
      kernel,
      grid=(splits,),
      out_shape=jax.ShapeDtypeStruct((splits, rows, d), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="fused_mlp",
  )(jnp.pad(x, ((0, rows - m), (0, 0))), w_gate_up, w_down)
  return out[:, :m]
