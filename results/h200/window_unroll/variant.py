"""Probe: the step with the window / listed attention kernel's tunings that
probe.py found fastest (its best.json), one variant per process, vanilla in
the same process.

  default   the package as shipped;
  best      `default_tuning` (the draft's window) and `listed_tuning` (a
            sparse verify layer) of kernels/window_attention/gpu.py updated
            with best.json's `window` and `listed` tunings (a kind whose best
            is the default, or missing, stays as shipped).

Usage (repository root): python results/h200/window_unroll/variant.py
  --variant=best --best=DIR/best.json --module=bench_e2e [the module's flags]
"""
from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels.window_attention import gpu as window_gpu  # noqa: E402


def apply(variant: str, best_path: str) -> dict:
  if variant == "default":
    return {}
  if variant != "best":
    raise ValueError(f"unknown variant {variant!r}: default or best")
  with open(best_path) as f:
    best = json.load(f)
  applied = {}
  for kind, name in (("window", "default_tuning"), ("listed", "listed_tuning")):
    tuning = (best.get(kind) or {}).get("tuning")
    if isinstance(tuning, dict) and tuning:
      shipped = getattr(window_gpu, name)
      setattr(window_gpu, name, lambda *a, _s=shipped, _t=tuning: _s(*a) | _t)
      applied[kind] = tuning
  return applied


def main():
  args, rest = {}, []
  for a in sys.argv[1:]:
    key = a.split("=", 1)[0]
    if key in ("--variant", "--best", "--module"):
      args[key[2:]] = a.split("=", 1)[1]
    else:
      rest.append(a)
  applied = apply(args.get("variant", "default"), args.get("best", "best.json"))
  print("variant", args.get("variant"), "tunings", json.dumps(applied), flush=True)
  sys.argv = [args["module"]] + rest
  runpy.run_module(f"scripts.{args['module']}", run_name="__main__")


if __name__ == "__main__":
  main()
