"""Speculative decoding: the step (`step.spec_step_fn`, the one composition
of draft -> select -> verify -> accept -> commit) and its driver (`engine`)."""
