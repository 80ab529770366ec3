"""Streaming-window attention of the draft (attention-sink rows + the recent
window + the new block) with RoPE applied and the new K/V rows written into
the cache, in one kernel.

Public entry: ``kernels.window_attention.ops.window_attention``.
"""
