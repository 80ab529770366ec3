"""A GEMM of a few rows added into an f32 buffer, its work spread evenly over
every SM: ``acc + x @ w`` (a verify layer's projections at 16-128 rows).

Public entry: ``kernels.streamk_matmul.ops.streamk_matmul``.
"""
