"""Matmuls of a few rows against a large weight with the neighbours of the
GEMM fused: an RMSNorm prologue, a bias, a SiLU-gated product and a residual
epilogue.  One kernel per projection of a small model's decode layer.

Public entry: ``kernels.skinny_matmul.ops.skinny_matmul``.
"""
