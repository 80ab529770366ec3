"""Pure-jnp layer finish: the oracle and the fallback.

For the residual stream `x` [M, D] entering a layer and its attention output
`attn` [M, A] (heads flattened), with the layer's o projection `w_o` [A, D],
post-attention RMSNorm weight `norm_w` [D], gate/up projection `w_gate_up`
[D, 2F] (columns interleaved: 2j is gate_j, 2j + 1 is up_j) and down
projection `w_down` [F, D]:

  y   = x + (attn @ w_o)                      the product rounded to x's dtype
  n   = norm_w * (y * rsqrt(mean(y^2) + eps))  in f32, rounded before the weight
  g,u = n @ w_gate_up                         rounded to x's dtype
  out = y + (SiLU(g) * u) @ w_down

which is what `dustin_jax.models.decoder.Block.finish` computes op by op.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps):
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return weight * xf.astype(x.dtype)


def layer_finish_reference(x, attn, w_o, norm_w, w_gate_up, w_down, *, eps):
  dt = x.dtype
  y = x + jnp.dot(attn, w_o, preferred_element_type=dt)
  gate_up = jnp.dot(rms_norm(y, norm_w, eps), w_gate_up, preferred_element_type=dt)
  gate_up = gate_up.reshape(gate_up.shape[:-1] + (-1, 2))
  h = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]
  return y + jnp.dot(h, w_down, preferred_element_type=dt)
