"""Importance scores of a few semantic retrieval heads over the full context.

Public entry: ``kernels.srh_scores.ops.srh_scores`` / ``select_topk``.
"""
