"""Public entry point of window attention with the new rows written."""
from __future__ import annotations

from kernels import common
from kernels.window_attention.gpu import window_attention_gpu
from kernels.window_attention.reference import window_attention_reference


def window_attention(qkv, k_cache, v_cache, lengths, cos, sin, *, n_sink,
                     n_window, scale=None, impl="auto", interpret=False,
                     **tuning):
  """RoPE, cache write and sink + window + block attention of one layer-pass.

  Args:
    qkv: [B, T, Hkv, G + 2, D], G = Hq // Hkv: the new block's q, k_new and
      v_new packed per KV head h (the layout of the model's fused qkv
      projection): qkv[:, :, h, :G] are the query heads h * G .. h * G + G - 1,
      qkv[:, :, h, G] is k_new and qkv[:, :, h, G + 1] v_new of head h.  q and
      k before RoPE.
    k_cache, v_cache: [B, Hkv, S, D], qkv's dtype (bf16 or f32).
    lengths: int32[B] context rows already in the cache; the T new rows go to
      lengths[b] .. lengths[b] + T - 1, all < S (caller's guarantee).
    cos, sin: [B, T, D // 2] f32 RoPE tables of those positions (rotate-half:
      rope([x1, x2]) = [x1 cos - x2 sin, x2 cos + x1 sin]).
    n_sink, n_window: static ints; query t attends to the context rows
      [0, min(n_sink, L)) and [max(n_sink, L - n_window), L), L = lengths[b],
      and causally to the block rows L .. L + t (GQA: head h reads KV head
      h // (Hq // Hkv)).
    scale: softmax scale, default 1/sqrt(D).
    impl: "auto" (gpu on GPU, reference elsewhere), "reference", "gpu"
      (Pallas Triton; head_dim a power of two >= 16), or "tpu", which runs
      the reference (no TPU kernel).
    interpret: Pallas interpret mode (CPU tests of the gpu kernel).
    **tuning: gpu: block_w (window tile rows, a power of two >= 16),
      splits (programs per (sequence, KV head) sharing the window tiles,
      their partial results merged after; 1: one program normalises in
      place), num_warps, num_stages, prefetch (each tile's loads issued
      before the previous tile's math).  Ignored by the reference.
  Returns:
    (out [B, T, Hq, D] in qkv's dtype, k_cache, v_cache) with the roped k rows
    and the v rows written.  The gpu kernel updates the caches in place
    (aliased outputs) when their buffers are donated.
  """
  impl = common.resolve_impl(impl)
  if impl == "gpu":
    return window_attention_gpu(qkv, k_cache, v_cache, lengths, cos, sin,
                                n_sink=n_sink, n_window=n_window, scale=scale,
                                interpret=interpret, **tuning)
  return window_attention_reference(qkv, k_cache, v_cache, lengths, cos, sin,
                                    n_sink=n_sink, n_window=n_window,
                                    scale=scale)
