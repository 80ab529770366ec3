"""Pure-jnp reference of ``skinny_matmul``: the oracle and the fallback."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def skinny_matmul_reference(x, w, row_scale=None, bias=None) -> jax.Array:
  """``(x @ w) * row_scale[:, None] + bias`` in x's dtype.

  Args:
    x: [M, K] activations.
    w: [K, N] weight, x's dtype.
    row_scale: optional f32[M], multiplies each row of the product.
    bias: optional [N], added after the scale.
  Returns:
    [M, N] in x's dtype; the product accumulates in f32 and the epilogue
    runs in f32 before the one rounding.
  """
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  if row_scale is not None:
    y = y * row_scale.astype(jnp.float32)[:, None]
  if bias is not None:
    y = y + bias.astype(jnp.float32)[None, :]
  return y.astype(x.dtype)


def skinny_matmul_partials_reference(x, w, splits: int) -> jax.Array:
  """f32 [splits, M, N]: slice s is x[:, K_s] @ w[K_s, :] over the s-th of
  `splits` equal slices of K."""
  m, k = x.shape
  if k % splits:
    raise ValueError(f"skinny_matmul: K={k} does not split into {splits} equal slices")
  xs = x.reshape(m, splits, k // splits)
  ws = w.reshape(splits, k // splits, w.shape[1])
  return jnp.einsum("msk,skn->smn", xs, ws, preferred_element_type=jnp.float32)
