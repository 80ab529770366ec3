"""Streaming-window attention of the draft (attention-sink rows + the recent
window + the new block) with RoPE applied and the new K/V rows written into
the cache, in one kernel.  The new block's q, k and v come as one packed
array [B, T, Hkv, G + 2, D], the fused qkv projection's output as is.

Public entries: ``kernels.window_attention.ops.window_attention`` (Pallas
Triton on GPU) and ``ops.window_attention_rows`` (the output as token rows;
"mosaic": a Mosaic GPU kernel for Hopper, `mosaic_gpu`).
"""
