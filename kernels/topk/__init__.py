"""Exact top-k of each row of a score matrix (scores [B, S] -> the k largest
values and their int32 indices, ties to the lower index, as ``lax.top_k``),
returned in ascending index order rather than by value: the set is what the
sparse selection needs, and no sort of the row is done to find it.  A radix
search over order-preserving int32 keys finds the k-th largest key, then one
walk of the row writes the selected positions; the Pallas Triton kernel does
both per row (or per row chunk, then over the chunks' candidates), the
pure-jnp reference states the same contract with a sort.

Public entry: ``kernels.topk.ops.topk``.
"""
