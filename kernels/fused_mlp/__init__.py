"""A SwiGLU MLP of a few rows in one kernel: the gate/up projection, SiLU(gate)
x up and the down projection, returning the down projection's f32 partial
products over slices of the intermediate dimension (the consumer, the
residual add, sums them).

At a draft pass's 16 rows XLA runs the MLP as four kernels (the gate/up
GEMM, SiLU x up, the down GEMM split over its input, the split's sum) at
about a third of the copy bandwidth; this streams both weights once per
program with nothing in between.

Public entry: ``kernels.fused_mlp.ops.fused_mlp``.
"""
