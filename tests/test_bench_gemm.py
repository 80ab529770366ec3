"""scripts/bench_gemm on CPU: every projection timed, split-K equal to the dot."""

import json
import os
import subprocess
import sys


def test_bench_gemm_smoke(tmp_path):
  argv = [sys.executable, "-m", "scripts.bench_gemm", "--smoke", f"--out_dir={tmp_path}",
          "--rows=8,16", "--splits=2", "--repeats=1"]
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-2000:]
  recs = json.loads((tmp_path / "gemm.json").read_text())
  copy = [r for r in recs if r["kernel"] == "copy"]
  gemms = [r for r in recs if r["kernel"] == "gemm"]
  assert len(copy) == 1 and copy[0]["tbs"] > 0
  # tiny_hf: hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512
  want = {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64),
          "lm_head": (64, 512)}
  assert {(r["role"], r["proj"], r["k"], r["n"]) for r in gemms} == {
      (role, p, k, n) for role in ("target", "draft") for p, (k, n) in want.items()}
  # split-K runs where its K slices are >= 64 wide (only down's K = 128 here)
  assert {r["proj"] for r in gemms if r["variant"] == "split_k2"} == {"down"}
  for r in gemms:
    assert r["us"] > 0 and r["rows"] in (8, 16) and 0 < r["bw_frac"]
    assert r["max_abs_err"] <= 2e-2 * r["max_abs_ref"], r  # bf16 output rounding
  assert (tmp_path / "gemm.png").stat().st_size > 0
