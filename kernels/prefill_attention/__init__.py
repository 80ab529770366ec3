"""Causal self-attention of a whole right-padded prompt batch (prefill).

Public entry: ``kernels.prefill_attention.ops.prefill_attention``.
"""
