"""The seam between two attentions of a decoder pass at a few rows in one
kernel: layer i's o projection and residual, its SwiGLU MLP (the RMSNorm as
a row scale of the products) and residual, then layer i + 1's q/k/v
projection. The weights are read in the order the kernel streams them
(`reference.seam_layout`).

Public entry: ``kernels.layer_seam.ops.layer_seam``.
"""
