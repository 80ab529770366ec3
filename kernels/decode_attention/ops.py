"""Public entry point of full-cache verify/decode attention."""
from __future__ import annotations

import jax

from kernels import common
from kernels.decode_attention.gpu import decode_attention_gpu
from kernels.decode_attention.reference import decode_attention_reference
from kernels.decode_attention.tpu import decode_attention_tpu


def decode_attention(q, k, v, lengths, *, scale=None, impl="auto",
                     interpret=False, **tuning) -> jax.Array:
  """Causal verify attention of T new tokens over the whole KV cache.

  Args:
    q: [B, T, Hq, D] queries of the T tokens (already written to the cache at
      positions lengths[b] .. lengths[b] + T - 1).
    k, v: [B, Hkv, S, D] KV cache of one layer (head-major), bf16 or f32.
    lengths: int32[B] committed tokens per sequence (lengths[b] + T <= S).
    scale: softmax scale, default 1/sqrt(D).
    impl: "auto" (gpu on GPU, tpu on TPU, reference elsewhere), "reference",
      "gpu" (Pallas Triton) or "tpu" (Pallas Mosaic).
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    **tuning: kernel knobs. gpu: block_k, chunk, num_warps, num_stages;
      tpu: block_k, chunk.  Ignored by the reference.
  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  impl = common.resolve_impl(impl)
  if impl == "reference":
    return decode_attention_reference(q, k, v, lengths, scale=scale)
  if impl == "gpu":
    return decode_attention_gpu(q, k, v, lengths, scale=scale,
                                interpret=interpret, **tuning)
  return decode_attention_tpu(q, k, v, lengths, scale=scale,
                              interpret=interpret, **tuning)
