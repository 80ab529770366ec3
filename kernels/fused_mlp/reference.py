"""Pure-jnp reference of ``fused_mlp``: the oracle and the fallback."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def silu_up(gate_up: jax.Array) -> jax.Array:
  """SiLU(gate) x up of a gate/up product [..., 2F] whose columns come in
  pairs (column 2j gate_j, 2j + 1 up_j: the model's `gate_up_columns`), in
  the product's dtype."""
  pairs = gate_up.reshape(gate_up.shape[:-1] + (-1, 2))
  return jax.nn.silu(pairs[..., 0]) * pairs[..., 1]


def fused_mlp_reference(x, w_gate_up, w_down, splits: int) -> jax.Array:
  """f32 [splits, M, D]: the down projection of SiLU(gate) x up over
  `splits` equal slices of the intermediate dimension F (their sum is the
  MLP's output).

  Args:
    x: [M, D] normed activation rows.
    w_gate_up: [D, 2F], gate and up columns in pairs (`silu_up`).
    w_down: [F, D].
    splits: slices of F (F % splits == 0).
  The gate/up product and SiLU(gate) x up are rounded to x's dtype, as the
  model's projections round them; the down products accumulate in f32.
  """
  m = x.shape[0]
  f = w_down.shape[0]
  if f % splits:
    raise ValueError(f"fused_mlp: F={f} does not split into {splits} equal slices")
  h = silu_up(jnp.dot(x, w_gate_up, preferred_element_type=x.dtype))  # [M, F]
  hs = h.reshape(m, splits, f // splits)
  ws = w_down.reshape(splits, f // splits, w_down.shape[1])
  return jnp.einsum("msf,sfd->smd", hs, ws, preferred_element_type=jnp.float32)
