"""Public entry point of the layer finish (o projection, residual, RMSNorm,
SwiGLU MLP, residual) for a few rows."""
from __future__ import annotations

from kernels import common
from kernels.layer_finish.gpu import check_shapes, default_tuning, layer_finish_gpu
from kernels.layer_finish.reference import layer_finish_reference


def layer_finish(x, attn, w_o, norm_w, w_gate_up, w_down, *, eps, impl="auto",
                 interpret=False, **tuning):
  """The residual stream after a decoder layer, from the stream entering it
  and the layer's attention output.

  Args:
    x: [..., D] the residual stream entering the layer (bf16 or f32).
    attn: [..., A] the attention output, heads flattened (A = Hq x head_dim).
    w_o: [A, D] the o projection (no bias).
    norm_w: [D] the post-attention RMSNorm weight; `eps` its epsilon.
    w_gate_up: [D, 2F], gate and up columns interleaved (2j gate_j, 2j + 1
      up_j: `dustin_jax.models.decoder.gate_up_columns`).
    w_down: [F, D].
    impl: "auto" (gpu on GPU, reference elsewhere), "reference", "gpu"
      (Pallas Triton; D, A and F multiples of 16), or "tpu", which runs the
      reference.
    interpret: Pallas interpret mode (CPU tests of the gpu stages, run as
      separate calls).
    **tuning: gpu: programs (<= the SM count), block_k, bn_o, fu, ks, bn_d,
      bn_s, num_warps, num_stages, persistent (False: one call per stage),
      return_counters (the barrier counters as a second output, for tests).
  Returns:
    [..., D] in x's dtype.
  """
  impl = common.resolve_impl(impl)
  x2, attn2 = x.reshape(-1, x.shape[-1]), attn.reshape(-1, attn.shape[-1])
  m, d, a, f = check_shapes(x2, attn2, w_o, norm_w, w_gate_up, w_down)
  if impl != "gpu":
    return layer_finish_reference(x, attn, w_o, norm_w, w_gate_up, w_down, eps=eps)
  kw = default_tuning(m, d, a, f)
  kw.update(tuning)
  out = layer_finish_gpu(x2, attn2, w_o, norm_w, w_gate_up, w_down, eps=eps,
                         interpret=interpret, **kw)
  if kw.get("return_counters"):
    return out[0].reshape(x.shape), out[1]
  return out.reshape(x.shape)
