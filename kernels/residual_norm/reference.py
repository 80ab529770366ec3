"""Pure-jnp residual add + RMSNorm: the oracle and the fallback.

With x [..., d] the residual stream, parts [S, ..., d] the S partial products
of a projection (their sum is the projection's output) and weight [d]:
  y = parts[0] + parts[1] + ... + parts[S - 1]    (f32, in that order)
  x_new = x + y.astype(x.dtype)
  normed = RMSNorm(x_new)    (``dustin_jax.models.decoder.RMSNorm``)
and parts=None means y = 0: x_new is x itself.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def check_shapes(x, parts, weight):
  """Validates the arguments; returns (R, d, S): rows, row width, parts (0 for
  parts=None)."""
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float array [..., d], got "
                     f"{x.dtype}{list(x.shape)}")
  d = x.shape[-1]
  if weight.shape != (d,) or weight.dtype != x.dtype:
    raise ValueError(f"weight must be {x.dtype}[d={d}] (x's dtype and last "
                     f"axis), got {weight.dtype}{list(weight.shape)}")
  S = 0
  if parts is not None:
    if (parts.ndim != x.ndim + 1 or parts.shape[1:] != x.shape
        or parts.shape[0] < 1):
      raise ValueError(f"parts must be [S >= 1, *x.shape] = [S, "
                       f"{', '.join(map(str, x.shape))}], got "
                       f"{list(parts.shape)}")
    if not jnp.issubdtype(parts.dtype, jnp.floating):
      raise ValueError(f"parts must be a float array, got {parts.dtype}")
    S = parts.shape[0]
  R = 1
  for n in x.shape[:-1]:
    R *= n
  return R, d, S


def residual_norm_reference(x, parts, weight, *, eps):
  """(x_new, normed), both [..., d] in x's dtype; see the module docstring."""
  check_shapes(x, parts, weight)
  if parts is not None:
    # a Python loop of adds, so XLA keeps the order s = 0, 1, ..., S - 1
    y = parts[0].astype(jnp.float32)
    for s in range(1, parts.shape[0]):
      y = y + parts[s].astype(jnp.float32)
    x = x + y.astype(x.dtype)
  # RMSNorm.__call__ of dustin_jax.models.decoder
  xf = x.astype(jnp.float32)
  xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return x, weight * xf.astype(x.dtype)
