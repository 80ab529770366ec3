"""A projection of a few rows (a decode or draft step's 1-64 activation rows)
that streams its weight through shared memory at the copy bandwidth: a
warp-specialised Mosaic GPU kernel (TMA loads in one warpgroup, WGMMA in
another), optionally with the SwiGLU gate x up product as its epilogue.

Public entry: ``kernels.stream_matmul.ops.stream_matmul``.
"""
