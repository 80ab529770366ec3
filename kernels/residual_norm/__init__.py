"""The end of a decode layer's projection and the start of the next block in
one kernel: the S partial products of a split-K projection summed in f32, the
sum added to the residual stream, and the next RMSNorm applied, returning both
the new residual stream and the normed input of the next projection.  At the
few rows of a decode step (16-80) the op-by-op path is 2-3 small,
latency-bound XLA kernels; this is one launch with the same arithmetic.

Public entry: ``kernels.residual_norm.ops.residual_norm``.
"""
