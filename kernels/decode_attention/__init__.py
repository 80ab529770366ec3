"""Full-cache split-K verify/decode attention (the project's baseline).

Public entry: ``kernels.decode_attention.ops.decode_attention``.
"""
