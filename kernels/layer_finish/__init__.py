"""The second half of a decoder layer for a few rows -- o projection and
residual add, RMSNorm, SwiGLU MLP and residual add -- as one persistent
kernel (a draft layer-pass at batch 1-16).

Public entry: ``kernels.layer_finish.ops.layer_finish``.
"""
