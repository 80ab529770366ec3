"""Public entry point of causal prefill attention."""
from __future__ import annotations

import jax

from kernels import common


def prefill_attention(q, k, v, lengths, *, scale=None, impl="auto",
                      **tuning) -> jax.Array:
  """Causal self-attention of a right-padded prompt batch.

  Args:
    q: [B, S, Hq, D] queries of every prompt token (after rope).
    k, v: [B, S, Hkv, D] keys / values of the same tokens (Hq a multiple of
      Hkv: GQA, KV heads are never repeated).
    lengths: int32[B] valid tokens per sequence; rows past it are padding.
    scale: softmax scale, default 1/sqrt(D).
    impl: "auto" (gpu on GPU, tpu on TPU, reference elsewhere), "reference"
      (blockwise jnp), "gpu" (cuDNN flash attention; f32 inputs run the
      reference) or "tpu" (Pallas splash attention).
    **tuning: reference: block_q, block_k; tpu: block, interpret.
  Returns:
    [B, S, Hq, D] in q's dtype; rows past lengths[b] are zero.
  """
  impl = common.resolve_impl(impl)
  if impl == "reference":
    from kernels.prefill_attention.reference import prefill_attention_reference
    return prefill_attention_reference(q, k, v, lengths, scale=scale, **tuning)
  if impl == "gpu":
    from kernels.prefill_attention.gpu import prefill_attention_gpu
    return prefill_attention_gpu(q, k, v, lengths, scale=scale, **tuning)
  from kernels.prefill_attention.tpu import prefill_attention_tpu
  return prefill_attention_tpu(q, k, v, lengths, scale=scale, **tuning)
