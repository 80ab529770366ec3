"""Sparse verify attention over gathered KV rows (I_verify) + the new block.

Public entry: ``kernels.sparse_verify.ops.sparse_verify``.
"""
