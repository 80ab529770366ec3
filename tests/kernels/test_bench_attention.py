"""scripts/bench_attention.py --smoke runs on CPU and writes the JSON schema
the project's reports read (and a PNG)."""
import json
import os
import subprocess
import sys

from conftest import python_path, xla_flags

REQUIRED = {"kernel", "model", "batch", "context", "budget", "ms", "bytes",
            "bw_share", "speedup_vs_decode_attention", "device", "jax_version",
            "copy_bw_tbs"}


def test_bench_smoke(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  env = dict(os.environ, PYTHONPATH=python_path(root), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags()  # one CPU device
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench_attention", "--smoke",
       f"--out_dir={tmp_path}"], cwd=root, env=env, capture_output=True,
      text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = json.load(open(tmp_path / "attention.json"))
  assert (tmp_path / "attention.png").stat().st_size > 1000
  kernels = {r["kernel"] for r in recs}
  assert {"copy", "decode_attention", "sparse_verify", "xla_reference",
          "srh_scores", "topk", "srh_scores+topk", "topk_kernel",
          "srh_scores+topk_kernel", "sparse_verify_packed",
          "sparse_verify_packed:no_prefetch"} <= kernels
  for r in recs:
    assert REQUIRED <= set(r), REQUIRED - set(r)
    assert r["ms"] > 0 and r["bytes"] > 0 and r["copy_bw_tbs"] > 0
  dec = [r for r in recs if r["kernel"] == "decode_attention"]
  assert dec[0]["speedup_vs_decode_attention"] == 1.0
  sv = [r for r in recs if r["kernel"] == "sparse_verify"]
  assert sorted(r["budget"] for r in sv) == [8, 16]
  assert all(r["bytes"] < dec[0]["bytes"] for r in sv)
  assert any("ratio_vs_28x_decode" in r for r in recs)
  # --check: outputs against the references (f32 on CPU)
  assert dec[0]["rel_err_vs_reference"] < 1e-4
  assert [r["rel_err_vs_reference"] < 1e-4 for r in sv if "rel_err_vs_reference" in r] == [True]


def test_budget_shapes_choose_where_every_budget_runs(tmp_path):
  """--budget_shapes names the shapes where sparse_verify runs every budget;
  elsewhere (here: the smoke run's only shape) it runs one."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  env = dict(os.environ, PYTHONPATH=python_path(root), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags()  # one CPU device
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench_attention", "--smoke", "--kernels=sparse",
       "--budget_shapes=4096:4", "--compile_cache=", f"--out_dir={tmp_path}"], cwd=root,
      env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recs = json.load(open(tmp_path / "attention.json"))
  assert sorted(r["budget"] for r in recs if r["kernel"] == "sparse_verify") == [8]


def test_sparse_sweep_times_each_tuning_of_both_sparse_kernels(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  env = dict(os.environ, PYTHONPATH=python_path(root), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags()  # one CPU device
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench_attention", "--smoke", "--kernels=sparse,packed",
       "--sparse_sweep", "--compile_cache=", f"--out_dir={tmp_path}"],
      cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  names = [r["kernel"] for r in json.load(open(tmp_path / "attention.json"))]
  for kernel, base, block in (("sparse", "sparse_verify", "block_k"),
                              ("packed", "sparse_verify_packed", "block_w")):
    swept = {n for n in names if n.startswith(base + ":splits=")}
    assert len(swept) == 16
    assert f"{base}:splits=6:{block}=32:num_warps=4" in swept


def test_parse_device_times_unions_gpu_stream_kernels():
  from scripts.benchmarking import parse_device_times
  M = lambda pid, tid, kind, name: dict(ph="M", pid=pid, tid=tid, name=kind,
                                        args=dict(name=name))
  X = lambda pid, tid, ts, dur, name="k": dict(ph="X", pid=pid, tid=tid,
                                               ts=ts, dur=dur, name=name)
  ev = [M(1, 0, "process_name", "/host:CPU"),
        M(2, 0, "process_name", "/device:GPU:0"),
        M(2, 7, "thread_name", "Stream #13(compute)"),
        M(2, 8, "thread_name", "XLA Ops"),
        X(1, 0, 100, 100, "a"), X(1, 0, 300, 100, "b"),
        X(2, 7, 110, 10), X(2, 7, 115, 10), X(2, 7, 150, 20),  # a: 15 + 20
        X(2, 8, 110, 60),  # op line: ignored
        X(2, 7, 310, 30)]  # b
  (busy_a, span_a), (busy_b, span_b) = parse_device_times(
      ev, ["a", "b"], [1, 2])
  assert abs(busy_a - 0.035) < 1e-9 and abs(span_a - 0.060) < 1e-9
  assert abs(busy_b - 0.015) < 1e-9 and abs(span_b - 0.015) < 1e-9


def test_unknown_kernel_name_is_refused(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  env = dict(os.environ, PYTHONPATH=python_path(root), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "scripts.bench_attention", "--smoke", "--kernels=decode,jax_gqa",
       f"--out_dir={tmp_path}"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "--kernels takes names of decode, sparse" in proc.stderr
  assert not (tmp_path / "attention.json").exists()
