"""A projection of a few activation rows: ``(x @ w) * row_scale + bias``.

At decode and verify the rows are few (batch x tokens: 16-128) and the
weight is read once, so the product is a weight stream: its floor is the
weight's bytes at the copy bandwidth. The Mosaic GPU kernel streams weight
tiles through shared memory (TMA, a few stages deep) into WGMMA with the
rows padded to WGMMA's 64-row operand, and applies a per-row scale (an
RMSNorm's 1 / rms, whose gain is folded into the weight) and a bias in
its epilogue, so neither needs a kernel of its own. The pure-jnp reference
states the contract.

Public entry: ``kernels.skinny_matmul.ops.skinny_matmul``.
"""
