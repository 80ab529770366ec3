"""Offline SRH profiling (Algorithm 1 of the paper).

* `collect`: per verify step of real lossless speculative decoding on
  calibration text, the target's full attention (what ARR counts) and the
  signal of every draft and target (layer, head), cached as npz per item;
* `search`: the greedy search over layers/heads with m re-optimised, which
  writes the SRH JSON read by `selection.srh.load_srh`;
* `runtime`: the model pair, one shared prefill, the policy loop (also used
  by scripts/eval_longctx.py).
"""
