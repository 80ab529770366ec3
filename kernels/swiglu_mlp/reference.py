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

BLOCK = 64  # F rows per program and weight rows per streamed tile
TILE_COLS = 2 * BLOCK  # a streamed tile's columns: a block's gate | up, or D columns of down


def stream_layout(gate_up: jax.Array, down: jax.Array) -> jax.Array:
  """The MLP's weights as the kernel streams them: [F / 64, S * 64, 128].

  gate_up [D, 2F] with gate_j in column 2j and up_j in 2j + 1 (the model's
  `gate_up_columns`), down [F, D]; D a multiple of 128, F of 64. Row block
  p holds everything program p reads, tile after tile (64 rows each):
  D / 64 tiles of [gate | up] columns of F block p (rows k*64 .. k*64+63
  of D), then D / 128 tiles of down rows of F block p (columns c*128 ..
  c*128+127 of D). So S = D / 64 + D / 128."""
  d, f2 = gate_up.shape
  f = f2 // 2
  if down.shape != (f, d) or d % TILE_COLS or f % BLOCK:
    raise ValueError(f"gate_up [D, 2F] and down [F, D] with D % {TILE_COLS} == 0 and "
                     f"F % {BLOCK} == 0, got {gate_up.shape} and {down.shape}")
  p = f // BLOCK
  gate = gate_up[:, 0::2].reshape(d // BLOCK, BLOCK, p, BLOCK)
  up = gate_up[:, 1::2].reshape(d // BLOCK, BLOCK, p, BLOCK)
  gate_up_tiles = jnp.concatenate([gate, up], axis=-1).transpose(2, 0, 1, 3)
  down_tiles = down.reshape(p, BLOCK, d // TILE_COLS, TILE_COLS).transpose(0, 2, 1, 3)
  return jnp.concatenate([gate_up_tiles, down_tiles], axis=1).reshape(p, -1, TILE_COLS)


def unstream_layout(w_stream: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
  """The inverse of `stream_layout`: (gate_up [D, 2F], down [F, D])."""
  p = w_stream.shape[0]
  tiles = w_stream.reshape(p, -1, BLOCK, TILE_COLS)
  n_gu = d // BLOCK
  gu = tiles[:, :n_gu].transpose(1, 2, 0, 3)  # [D/64, 64, P, 128]
  gate = gu[..., :BLOCK].reshape(d, p * BLOCK)
  up = gu[..., BLOCK:].reshape(d, p * BLOCK)
  gate_up = jnp.stack([gate, up], axis=-1).reshape(d, -1)
  down = tiles[:, n_gu:].transpose(0, 2, 1, 3).reshape(p * BLOCK, d)
  return gate_up, down


def swiglu_mlp_reference(x: jax.Array, w_stream: jax.Array, residual: jax.Array) -> jax.Array:
  gate_up, down = unstream_layout(w_stream, x.shape[-1])
  y = jnp.dot(x, gate_up, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(y[:, 0::2]) * y[:, 1::2]).astype(x.dtype)
  return residual.astype(jnp.float32) + jnp.dot(h, down, preferred_element_type=jnp.float32)
