"""Causal prefill attention on NVIDIA GPUs: cuDNN flash attention.

``jax.nn.dot_product_attention(implementation="cudnn")`` with
``is_causal=True`` and per-sequence ``query_seq_lengths`` /
``key_value_seq_lengths`` (cuDNN's PADDING_CAUSAL mask): causal blocks above
the diagonal and key blocks past a sequence's length are never computed, and
GQA is native (K/V keep their Hkv heads, the layout is [B, S, H, D] as here).

Constraints of the cuDNN path (checked by jax before lowering): fp16/bf16
only, q/k/v of one dtype, head_dim a multiple of 8 and <= 256 on Hopper
(<= 128 before). f32 inputs are NOT cast down here: a silent bf16 round trip
would change an f32 model's numbers, so they go to the blockwise reference
(``prefill_attention_gpu`` says which ran through ``uses_cudnn``). Sequences
of length 0 are given length 1 (cuDNN's behaviour on an empty row is not
specified); padding rows of k and v are zeroed before the call and rows past
``lengths`` of the output after it, as the reference returns them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.prefill_attention.reference import (check_prefill_shapes,
                                                 prefill_attention_reference)

CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


def uses_cudnn(q, k, v) -> bool:
  """Whether these inputs take the cuDNN path (else the reference)."""
  dts = {jnp.dtype(x.dtype) for x in (q, k, v)}
  d = q.shape[-1]
  return (len(dts) == 1 and dts.pop() in {jnp.dtype(t) for t in CUDNN_DTYPES}
          and d % 8 == 0 and d <= 256)


def prefill_attention_gpu(q, k, v, lengths, *, scale=None, **tuning):
  B, S, Hq, D, Hkv = check_prefill_shapes(q, k, v, lengths)
  if not uses_cudnn(q, k, v):
    return prefill_attention_reference(q, k, v, lengths, scale=scale, **tuning)
  lengths = lengths.astype(jnp.int32)
  valid = jnp.arange(S, dtype=jnp.int32)[None, :] < lengths[:, None]
  # padding rows zeroed: whatever they hold (NaN garbage too) cannot reach a
  # valid row through a masked logit or a zero weight
  zero = lambda x: jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))
  k, v = zero(k), zero(v)
  seq = jnp.maximum(lengths, 1)
  out = jax.nn.dot_product_attention(
      q, k, v, scale=common.default_scale(D, scale), is_causal=True,
      query_seq_lengths=seq, key_value_seq_lengths=seq, implementation="cudnn")
  return zero(out)
