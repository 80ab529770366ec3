"""A decoder layer's SwiGLU MLP and its residual add for a few rows, in one
kernel: ``residual + down(silu(x @ gate) * (x @ up))``. The weights are read
in the order the kernel streams them (`reference.stream_layout`).

Public entry: ``kernels.swiglu_mlp.ops.swiglu_mlp``.
"""
