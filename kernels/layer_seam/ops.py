"""Public entry point: the seam between two attentions of a decoder pass at
a few rows (o, residual, MLP, residual, next q/k/v) as one kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.layer_seam.gpu import fits, layer_seam_gpu, programs_needed
from kernels.layer_seam.reference import BLOCK, COLS, SeamDims, layer_seam_reference


def layer_seam(r, attn, stream, xb, ss, qkv, layer: int, *, dims: SeamDims, has_next: bool,
               eps: float, impl: str = "auto", stages: int | None = None):
  """Layer `layer`'s o projection, residual, RMSNorm (its weight folded into
  gate/up), SwiGLU MLP and residual, then (`has_next`) layer `layer + 1`'s
  q/k/v projection of the result, unscaled and without bias
  (`reference.py` has the contract).

  Args:
    r: [Mp, D] f32, the residual stream entering the layer; Mp <= 64 rows, a
      multiple of 8 (rows past the tokens zero).
    attn: [Mp, A], the layer's attention output (the stream's dtype).
    stream: `reference.seam_layout` of every layer, stacked row-wise.
    xb: [Mp, D] in the stream's dtype, ss: [Mp, 64] f32 zero, qkv: [Mp, Nq]
      f32: the kernel's working buffers, threaded from call to call (ss is
      zero again after a call with has_next).
    impl: "auto" (the kernel on a Hopper GPU where it fits, else the
      reference), "gpu" or "reference".
  Returns:
    (r', xb, ss, qkv): the residual after the layer, the buffers, and the
    next layer's q/k/v (`qkv` unchanged without has_next).
  """
  dims.check()
  mp, d = r.shape
  if d != dims.d or attn.shape != (mp, dims.a) or r.dtype != jnp.float32:
    raise ValueError(f"r must be [Mp, {dims.d}] f32 and attn [Mp, {dims.a}], got r "
                     f"{r.shape} {r.dtype} and attn {attn.shape}")
  if xb.shape != (mp, d) or ss.shape != (mp, BLOCK) or qkv.shape != (mp, dims.nq):
    raise ValueError(f"xb [Mp, D], ss [Mp, {BLOCK}] and qkv [Mp, Nq] for Mp={mp}, got "
                     f"{xb.shape}, {ss.shape} and {qkv.shape}")
  needed = (layer + 1 + int(has_next)) * dims.blocks * BLOCK
  if stream.ndim != 2 or stream.shape[1] != COLS or stream.shape[0] < needed:
    raise ValueError(f"stream must be seam_layout's blocks of every layer, [>= {needed}, "
                     f"{COLS}] for layer {layer}, got {stream.shape}")
  if impl == "auto":
    impl = ("gpu" if common.is_hopper() and fits(dims, mp, stages, common.num_sms())
            else "reference")
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    if (stream.dtype not in (jnp.bfloat16, jnp.float16)
        or not fits(dims, mp, stages, common.num_sms())):
      raise ValueError(f"the kernel takes bf16 or f16 weights, Mp a multiple of 8 up to 64 and "
                       f"{dims} within {common.num_sms()} SMs; got {stream.dtype}, Mp={mp}")
    return layer_seam_gpu(attn.astype(stream.dtype), stream, r, xb, ss, qkv, layer, dims=dims,
                          has_next=has_next, eps=float(eps), programs=programs_needed(dims),
                          stages=stages)
  r_out, qkv_out = layer_seam_reference(r, attn, stream, layer=layer, dims=dims,
                                        has_next=has_next, eps=eps)
  return r_out, xb, jnp.zeros_like(ss), qkv if qkv_out is None else qkv_out
