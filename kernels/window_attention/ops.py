"""Public entry point of window attention with the new rows written."""
from __future__ import annotations

from kernels import common
from kernels.window_attention import mosaic_gpu
from kernels.window_attention.gpu import window_attention_gpu
from kernels.window_attention.reference import check_shapes, window_attention_reference


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
      before the previous tile's math), unroll (all of a program's tiles
      loaded before any math; prefetch then has no effect).  Ignored by
      the reference.
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


def window_attention_rows(qkv, k_cache, v_cache, lengths, cos, sin, *, n_sink, n_window,
                          impl="auto", splits=None, **tuning):
  """`window_attention` with its output as token rows [B * T, Hq * D] (row
  b * T + t, query head h's columns h * D .. h * D + D - 1): the input
  layout of the o projection after it.

  impl "mosaic": the Mosaic GPU kernel (`mosaic_gpu`, Hopper; head_dim 64,
  T <= 8, G * T <= 64, 16-bit dtypes), which writes those rows itself, its
  inputs packed by one XLA fusion (`pack_window_inputs`); `splits` programs
  per (sequence, KV head), merged in the kernel (default:
  `mosaic_gpu.default_splits`). Any other impl: `window_attention` (its
  `tuning`), then a reshape. Returns (out, k_cache, v_cache)."""
  if impl == "mosaic":
    b, t, hkv, g2, _ = qkv.shape
    check_shapes(qkv, k_cache, v_cache, lengths, cos, sin, n_sink, n_window)
    splits = splits or mosaic_gpu.default_splits(b, hkv, int(n_window), qkv.shape[-1])
    if splits is None:
      raise ValueError(f"the Mosaic window kernel takes no split count at batch {b}, {hkv} KV "
                       f"heads and a window of {n_window} rows: the window tiles of each "
                       f"program must fit shared memory with all programs resident; use "
                       f"impl='gpu'")
    mosaic_gpu.check_args(qkv, k_cache, int(n_sink), int(n_window), splits)
    blocks = mosaic_gpu.pack_window_inputs(qkv, cos, sin)
    return mosaic_gpu.window_attention_rows_gpu(blocks, k_cache, v_cache, lengths,
                                                g=g2 - 2, t=t, n_sink=int(n_sink),
                                                n_window=int(n_window), splits=splits)
  out, k_cache, v_cache = window_attention(qkv, k_cache, v_cache, lengths, cos, sin,
                                           n_sink=n_sink, n_window=n_window, impl=impl,
                                           splits=splits, **tuning)
  b, t, hq, d = out.shape
  return out.reshape(b * t, hq * d), k_cache, v_cache
