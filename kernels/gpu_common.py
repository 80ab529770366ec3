"""Pieces shared by the Pallas Triton (GPU) kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt


def dot(a, b, trans_b=False):
  """A tile matmul with f32 accumulation (full precision for f32 inputs)."""
  prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plt.dot(a, b, trans_b=trans_b, precision=prec)


def packed_rows(M: int, G: int, T: int, Hq: int, h):
  """The M query rows of KV head `h` packed in one tile (r = t * G + g):
  (verify token t of each row, row holds a real query, its row in the
  [B, T * Hq, D] view of the queries; padding rows point past the end and
  are masked, never touched)."""
  r = jnp.arange(M, dtype=jnp.int32)
  t_r = r // G
  row_ok = r < G * T
  qrow = jnp.where(row_ok, t_r * Hq + h * G + (r % G), T * Hq)
  return t_r, row_ok, qrow


def softmax_init(rows: int, head_dim: int):
  """(o, m, l) of an online softmax over no keys yet."""
  return (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_update(o, m, l, s, v, *, guard_empty: bool = True):
  """One flash-attention step: fold logits `s` [M, BK] (log2 units, -inf
  where masked) and values `v` [BK, D] into the running (o, m, l).
  `guard_empty` keeps exp2 finite for rows that have seen no key yet."""
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard_empty else m_new
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(s - m_safe[:, None])
  l = l * alpha + jnp.sum(p, axis=1)
  o = o * alpha[:, None] + dot(p.astype(v.dtype), v)
  return o, m_new, l
