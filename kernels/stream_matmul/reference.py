"""Pure-jnp reference of ``stream_matmul``.

Contract (``stream_matmul_reference(x, w, swiglu=..., splits=..., block=...)``;
x [M, K], w [K, N], both bf16 or f16):
  * splits == 1, no swiglu: x @ w (+ bias [N]) with f32 accumulation, in
    x's dtype, [M, N];
  * swiglu: w's columns are blocks of `block` gate columns followed by the
    `block` up columns they pair with ([gate_0 | up_0 | gate_1 | up_1 ...]);
    the result is silu(gate) * up, computed in f32, in x's dtype, [M, N / 2];
  * splits > 1: the f32 partial products over `splits` equal slices of K,
    [splits, M, N] (their sum is x @ w), for a consumer that sums them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def stream_matmul_reference(x, w, bias=None, *, swiglu: bool = False, splits: int = 1,
                            block: int = 64) -> jax.Array:
  m, k = x.shape
  xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
  if splits > 1:
    ks = k // splits
    return jnp.einsum("msk,skn->smn", xf.reshape(m, splits, ks),
                      wf.reshape(splits, ks, -1))
  y = xf @ wf
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  if swiglu:
    y = y.reshape(m, -1, 2, block)
    y = jax.nn.silu(y[:, :, 0]) * y[:, :, 1]
    y = y.reshape(m, -1)
  return y.astype(x.dtype)
