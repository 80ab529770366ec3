"""Pieces shared by the Pallas TPU kernels: the packed query rows and the
split-K partial outputs (see kernels/common.py for the conventions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import common


def pack_queries(q, Hkv, M):
  """[B, T, Hq, D] -> [B, Hkv, M, D], row r = t * G + g (zero padded)."""
  B, T, Hq, D = q.shape
  G = Hq // Hkv
  qp = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)
  qp = qp.reshape(B, Hkv, T * G, D)
  return jnp.pad(qp, ((0, 0), (0, 0), (0, M - T * G), (0, 0)))


def unpack_rows(x, T, G):
  """[J, B, Hkv, M, ...] -> [J, B, T * Hq, ...] (natural row order)."""
  J, B, Hkv = x.shape[:3]
  rest = x.shape[4:]
  x = x[:, :, :, :T * G].reshape(J, B, Hkv, T, G, *rest)
  x = jnp.moveaxis(x, 3, 2)  # [J, B, T, Hkv, G, ...]
  return x.reshape(J, B, T * Hkv * G, *rest)


def partial_outputs(J, B, Hkv, M, D, index_map):
  """(out_specs, out_shape) of the split-K partials o [M, D], m and l [M, 1]
  per program; `index_map(b, h, j, ...)` must return (j, b, h, 0, 0)."""
  widths = (D, 1, 1)
  specs = [pl.BlockSpec((None, None, None, M, w), index_map) for w in widths]
  shapes = [jax.ShapeDtypeStruct((J, B, Hkv, M, w), jnp.float32) for w in widths]
  return specs, shapes


def merge_partials(o, m, l, T, G, dtype):
  """Packed partials -> attention output [B, T, Hq, D]."""
  B, Hkv, D = o.shape[1], o.shape[2], o.shape[-1]
  o = unpack_rows(o, T, G)
  m = unpack_rows(m, T, G)[..., 0]
  l = unpack_rows(l, T, G)[..., 0]
  return common.combine_partials(o, m, l, dtype).reshape(B, T, Hkv * G, D)
