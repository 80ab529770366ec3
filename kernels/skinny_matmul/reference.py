"""Pure-jnp skinny matmul with its fused neighbours: the oracle and the
fallback.

``y = norm(x) @ w (+ bias)``, then optionally ``silu(gate) * up`` of the
column pairs of ``y`` and ``residual + y``, where

* ``norm(x) = norm_weight * (x * rsqrt(mean(x**2) + eps))`` in f32, cast to
  x's dtype before the weight multiply (the Llama / Qwen RMSNorm);
* the product is rounded to x's dtype (f32 accumulation), with a bias added
  in f32 before that rounding;
* with ``glu``, ``w``'s columns alternate gate, up (column 2j is the gate of
  output j, 2j + 1 its up) and the output has half as many columns.

These are the same operations, in the same dtypes, as a decoder layer's
RMSNorm, Linear and gated MLP, so the reference reproduces the unfused model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_shapes(x, w, norm_weight, bias, glu, residual):
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"x must be [M, K] and w [K, N]; got {x.shape}, {w.shape}")
  M, K = x.shape
  N = w.shape[1]
  if glu and N % 2:
    raise ValueError(f"glu needs an even number of columns (gate, up pairs); got {N}")
  if glu and bias is not None:
    raise ValueError("glu with a bias is not supported")
  n_out = N // 2 if glu else N
  if norm_weight is not None and norm_weight.shape != (K,):
    raise ValueError(f"norm_weight must be [K={K}]; got {norm_weight.shape}")
  if bias is not None and bias.shape != (N,):
    raise ValueError(f"bias must be [N={N}]; got {bias.shape}")
  if residual is not None and residual.shape != (M, n_out):
    raise ValueError(f"residual must be [M, N_out] = {(M, n_out)}; got {residual.shape}")
  if w.dtype != x.dtype:
    raise ValueError(f"w ({w.dtype}) must have x's dtype {x.dtype}")
  return M, K, N, n_out


def rms_norm(x, weight, eps):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def skinny_matmul_reference(x, w, *, norm_weight=None, eps=1e-6, bias=None,
                            glu=False, residual=None):
  """Returns [M, N_out] in x's dtype (N_out = N, or N // 2 with glu)."""
  check_shapes(x, w, norm_weight, bias, glu, residual)
  if norm_weight is not None:
    x = rms_norm(x, norm_weight, eps)
  if bias is None:
    y = jnp.dot(x, w, preferred_element_type=x.dtype)
  else:
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    y = (y + bias.astype(jnp.float32)).astype(x.dtype)
  if glu:
    pairs = y.reshape(y.shape[0], -1, 2)
    y = jax.nn.silu(pairs[..., 0]) * pairs[..., 1]
  if residual is not None:
    y = residual + y
  return y
