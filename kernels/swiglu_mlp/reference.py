"""Pure-jnp reference of ``swiglu_mlp`` and the streamed weight layout.

Contract (``swiglu_mlp_reference(x, w_stream, residual)``): x [M, D] (bf16
or f16), the MLP's weights as `stream_layout` packs them, residual [M, D]
(any float dtype). The result is, in f32,

    residual + (silu(x @ gate) * (x @ up)) @ down

with the gate and up products accumulated in f32, their SwiGLU rounded to
x's dtype (the down product's operand, as in the model) and the down product
accumulated in f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 64  # F rows per program; a streamed tile is [2 x 64, 64]
TILE_ROWS = 2 * BLOCK  # a block's gate^T | up^T rows, or 128 D columns of down^T


def stream_layout(gate_up: jax.Array, down: jax.Array) -> jax.Array:
  """The MLP's weights as the kernel streams them: [F / 64, S * 128, 64],
  every tile transposed (output features in rows, inputs in columns), so
  that the weights are the kernel's 64-row product operand and the few
  activation rows the narrow one.

  gate_up [D, 2F] with gate_j in column 2j and up_j in 2j + 1 (the model's
  `gate_up_columns`), down [F, D]; D a multiple of 128, F of 64. Row block
  p holds everything program p reads, tile after tile (128 rows each):
  D / 64 tiles [gate^T ; up^T] of F block p (64 F rows each) over D columns
  k*64 .. k*64+63, then D / 128 tiles down^T of F block p over D rows
  c*128 .. c*128+127. So S = D / 64 + D / 128."""
  d, f2 = gate_up.shape
  f = f2 // 2
  if down.shape != (f, d) or d % TILE_ROWS or f % BLOCK:
    raise ValueError(f"gate_up [D, 2F] and down [F, D] with D % {TILE_ROWS} == 0 and "
                     f"F % {BLOCK} == 0, got {gate_up.shape} and {down.shape}")
  p = f // BLOCK
  # [D / 64, 64 (D), P, 64 (F)] -> [P, D / 64, 64 (F), 64 (D)]
  gate = gate_up[:, 0::2].reshape(d // BLOCK, BLOCK, p, BLOCK).transpose(2, 0, 3, 1)
  up = gate_up[:, 1::2].reshape(d // BLOCK, BLOCK, p, BLOCK).transpose(2, 0, 3, 1)
  # [P, 64 (F), D / 128, 128 (D)] -> [P, D / 128, 128 (D), 64 (F)]
  down_tiles = down.reshape(p, BLOCK, d // TILE_ROWS, TILE_ROWS).transpose(0, 2, 3, 1)
  tiles = jnp.concatenate([jnp.concatenate([gate, up], axis=2), down_tiles], axis=1)
  return tiles.reshape(p, -1, BLOCK)


def unstream_layout(w_stream: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
  """The inverse of `stream_layout`: (gate_up [D, 2F], down [F, D])."""
  p = w_stream.shape[0]
  tiles = w_stream.reshape(p, -1, TILE_ROWS, BLOCK)
  n_gu = d // BLOCK
  gu = tiles[:, :n_gu]  # [P, D / 64, 128, 64 (D)]
  gate = gu[:, :, :BLOCK].transpose(1, 3, 0, 2).reshape(d, p * BLOCK)
  up = gu[:, :, BLOCK:].transpose(1, 3, 0, 2).reshape(d, p * BLOCK)
  gate_up = jnp.stack([gate, up], axis=-1).reshape(d, -1)
  down = tiles[:, n_gu:].transpose(0, 3, 1, 2).reshape(p * BLOCK, d)
  return gate_up, down


def swiglu_mlp_reference(x: jax.Array, w_stream: jax.Array, residual: jax.Array) -> jax.Array:
  gate_up, down = unstream_layout(w_stream, x.shape[-1])
  y = jnp.dot(x, gate_up, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(y[:, 0::2]) * y[:, 1::2]).astype(x.dtype)
  return residual.astype(jnp.float32) + jnp.dot(h, down, preferred_element_type=jnp.float32)
