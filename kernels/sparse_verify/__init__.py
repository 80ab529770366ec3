"""Sparse verify attention over gathered KV rows (I_verify) + the new block.

Public entries: ``kernels.sparse_verify.ops.sparse_verify`` (q and the
caches with the block's rows already written) and
``kernels.sparse_verify.ops.sparse_verify_packed`` (from the layer's packed
q/k/v projection: RoPE, both cache writes and the attention in one kernel).
"""
