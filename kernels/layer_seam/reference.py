"""Pure-jnp reference of ``layer_seam`` and its streamed weight layout.

The seam between two attentions of a decoder pass at a few rows: layer i's
o projection and residual add, its RMSNorm and SwiGLU MLP and residual add,
then layer i + 1's q/k/v projection, as one kernel (gpu.py).

Contract (``layer_seam_reference(r, attn, stream, layer=i, ...)``), in f32
unless said otherwise, r [Mp, D] the residual stream of the Mp rows
(tokens; rows past the real ones stay zero), attn [Mp, A]:

    x_mid = r + attn @ o_i
    s     = rsqrt(mean(x_mid^2) + eps)                 per row
    g, u  = s * (bf16(x_mid) @ gate_i), s * (bf16(x_mid) @ up_i)
    r'    = x_mid + bf16(silu(g) * u) @ down_i
    qkv   = bf16(r') @ qkv_{i+1}                       (when has_next)

returning (r' [Mp, D], qkv [Mp, Nq]). The RMSNorm weights are folded into
gate/up and q/k/v (``Decoder.fold_norm_weights``), so the norm is the row
scale s, applied to the products (exact: a product is linear in its row).
The q/k/v projection is returned unscaled and without its bias: the
caller applies r''s row scale and the bias before the attention.

Layout (``seam_layout``): one layer's o [A, D], gate_up [D, 2F] (gate_j in
column 2j, up_j in 2j + 1), down [F, D] and qkv [D, Nq] as blocks of 64 x
128, in the order the kernel's programs stream them:
  * o: owner c (output columns 64c .. 64c + 63), step k: o[128k : 128k +
    64, 64c : 64c + 64] and o[128k + 64 : 128k + 128, 64c : 64c + 64] side
    by side;
  * the MLP: `kernels.swiglu_mlp`'s `stream_layout` (program j, F block j:
    D/64 [gate | up] blocks, then D/128 down blocks);
  * qkv: tile p = n * D/64 + k: qkv[64k : 64k + 64, 128n : 128n + 128].
A decoder's layers are stacked row-wise: layer i's blocks start at row
i * blocks_per_layer * 64.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels.swiglu_mlp.reference import stream_layout, unstream_layout

BLOCK = 64  # rows of a streamed block (its contraction), and output columns an o owner holds
COLS = 128  # columns of a streamed block


@dataclasses.dataclass(frozen=True)
class SeamDims:
  """Hidden size D, attention width A = Hq * head_dim, intermediate size F
  and q/k/v width Nq of a layer."""
  d: int
  a: int
  f: int
  nq: int

  def check(self):
    if self.d % COLS or self.a % COLS or self.f % BLOCK or self.nq % COLS:
      raise ValueError(f"layer_seam takes D, A and Nq multiples of {COLS} and F of {BLOCK}; "
                       f"got D={self.d}, A={self.a}, F={self.f}, Nq={self.nq}")
    return self

  @property
  def owners(self) -> int:  # programs of the o phase, 64 output columns each
    return self.d // BLOCK

  @property
  def o_steps(self) -> int:
    return self.a // COLS

  @property
  def mlp_programs(self) -> int:
    return self.f // BLOCK

  @property
  def gate_up_steps(self) -> int:
    return self.d // BLOCK

  @property
  def down_steps(self) -> int:
    return self.d // COLS

  @property
  def mlp_steps(self) -> int:
    return self.gate_up_steps + self.down_steps

  @property
  def qkv_tiles(self) -> int:
    return (self.nq // COLS) * (self.d // BLOCK)

  @property
  def o_blocks(self) -> int:
    return self.owners * self.o_steps

  @property
  def mlp_blocks(self) -> int:
    return self.mlp_programs * self.mlp_steps

  @property
  def blocks(self) -> int:  # per layer
    return self.o_blocks + self.mlp_blocks + self.qkv_tiles


def seam_layout(o, gate_up, down, qkv) -> jax.Array:
  """One layer's weights as the kernel streams them: [blocks * 64, 128]
  (see the module docstring)."""
  a, d = o.shape
  f = gate_up.shape[1] // 2
  dims = SeamDims(d, a, f, qkv.shape[1]).check()
  if gate_up.shape != (d, 2 * f) or down.shape != (f, d) or qkv.shape[0] != d:
    raise ValueError(f"o [A, D], gate_up [D, 2F], down [F, D], qkv [D, Nq]; got {o.shape}, "
                     f"{gate_up.shape}, {down.shape}, {qkv.shape}")
  # o [A/128, 2, 64, D/64, 64] -> [owner, step, 64 rows, (half, 64 columns)]
  o_blocks = o.reshape(dims.o_steps, 2, BLOCK, dims.owners, BLOCK).transpose(3, 0, 2, 1, 4)
  mlp_blocks = stream_layout(gate_up, down)
  qkv_blocks = qkv.reshape(d // BLOCK, BLOCK, dims.nq // COLS, COLS).transpose(2, 0, 1, 3)
  return jnp.concatenate([b.reshape(-1, COLS) for b in (o_blocks, mlp_blocks, qkv_blocks)])


def unseam_layout(stream, dims: SeamDims, layer: int):
  """Layer `layer`'s (o, gate_up, down, qkv) back from a stacked stream."""
  start = layer * dims.blocks * BLOCK
  rows = stream[start:start + dims.blocks * BLOCK]
  o_end = dims.o_blocks * BLOCK
  mlp_end = o_end + dims.mlp_blocks * BLOCK
  o = rows[:o_end].reshape(dims.owners, dims.o_steps, BLOCK, 2, BLOCK)
  o = o.transpose(1, 3, 2, 0, 4).reshape(dims.a, dims.d)
  gate_up, down = unstream_layout(rows[o_end:mlp_end].reshape(dims.mlp_programs, -1, COLS),
                                  dims.d)
  qkv = rows[mlp_end:].reshape(dims.nq // COLS, dims.d // BLOCK, BLOCK, COLS)
  qkv = qkv.transpose(1, 2, 0, 3).reshape(dims.d, dims.nq)
  return o, gate_up, down, qkv


def row_scale(x, eps):
  """RMSNorm's scale of each row of x [Mp, D] (f32)."""
  return jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def layer_seam_reference(r, attn, stream, *, layer: int, dims: SeamDims, has_next: bool,
                         eps: float):
  """See the module docstring. r [Mp, D] f32, attn [Mp, A]; returns
  (r' [Mp, D] f32, qkv [Mp, Nq] f32 or None)."""
  o, gate_up, down, _ = unseam_layout(stream, dims, layer)
  f32, dt = jnp.float32, stream.dtype
  x_mid = r + jnp.dot(attn.astype(dt), o, preferred_element_type=f32)
  s = row_scale(x_mid, eps)
  xb = x_mid.astype(dt)
  g = s * jnp.dot(xb, gate_up[:, 0::2], preferred_element_type=f32)
  u = s * jnp.dot(xb, gate_up[:, 1::2], preferred_element_type=f32)
  h = (jax.nn.silu(g) * u).astype(dt)
  r_out = x_mid + jnp.dot(h, down, preferred_element_type=f32)
  qkv = None
  if has_next:
    qkv_next = unseam_layout(stream, dims, layer + 1)[3]
    qkv = jnp.dot(r_out.astype(dt), qkv_next, preferred_element_type=f32)
  return r_out, qkv
