"""scripts/bench_gemm on CPU: every projection of both models timed at every row count."""

import json
import os
import subprocess
import sys


def test_bench_gemm_smoke(tmp_path):
  argv = [sys.executable, "-m", "scripts.bench_gemm", "--smoke", f"--out_dir={tmp_path}",
          "--rows=8,16", "--repeats=1"]
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
  assert sorted((r["role"], r["proj"], r["k"], r["n"], r["rows"]) for r in gemms) == sorted(
      (role, p, k, n, rows) for role in ("target", "draft") for p, (k, n) in want.items()
      for rows in (8, 16))
  # the CUDA graph serialized by default (each product alone, as in a
  # forward), in place of the concurrent default of the other scripts
  for r in recs:
    assert "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE" in r["xla_flags"]
    assert "=CONCURRENT" not in r["xla_flags"]
  for r in gemms:
    assert r["us"] > 0 and 0 < r["bw_frac"]
    assert r["tbs"] == r["weight_bytes"] / (r["us"] * 1e-6) / 1e12
  assert (tmp_path / "gemm.png").stat().st_size > 0


def test_partial_products_sum_to_the_product():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from scripts.benchmarking import partial_products
  x = jax.random.normal(jax.random.key(0), (5, 96), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (96, 40), jnp.float32)
  parts = partial_products(x, w, 4)
  assert parts.shape == (4, 5, 40) and parts.dtype == jnp.float32
  # part p is the product of the input slice p
  np.testing.assert_allclose(parts[2], x[:, 48:72] @ w[48:72], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(parts.sum(0), x @ w, rtol=1e-4, atol=1e-4)


def test_bench_gemm_parts_records(tmp_path):
  argv = [sys.executable, "-m", "scripts.bench_gemm", "--smoke", f"--out_dir={tmp_path}",
          "--rows=16", "--repeats=1", "--parts=1,4"]
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-2000:]
  gemms = [r for r in json.loads((tmp_path / "gemm.json").read_text()) if r["kernel"] == "gemm"]
  # every projection of the tiny pair (K a multiple of 4) once per parts value
  assert sorted({r["parts"] for r in gemms}) == [1, 4]
  assert len(gemms) == 2 * 2 * 5 and all(r["kernels_per_product"] >= 0 for r in gemms)
