"""scripts/bench_prefill.py writes the promised records and plot (tiny pair, CPU)."""

import json
import os
import subprocess
import sys


def test_bench_prefill_smoke_schema(tmp_path):
  out = tmp_path / "prefill.json"
  argv = [sys.executable, "-m", "scripts.bench_prefill", "--smoke", f"--out={out}",
          "--contexts=48,96", "--batches=2", "--ragged"]
  p = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  recs = json.loads(out.read_text())
  assert [(r["batch"], r["context"]) for r in recs] == [(2, 48), (2, 96)]
  keys = {"model", "batch", "context", "prefill_s", "target_s", "draft_s", "tokens_per_s",
          "anchor_s", "anchor_tokens_per_s", "impl", "device", "tokens"}
  for r in recs:
    assert not r.get("error") and not r.get("skipped"), r
    assert keys <= r.keys(), keys - r.keys()
    assert r["model"] == "tiny" and r["impl"] == "auto" and r["device"]
    assert r["target_s"] > 0 and r["draft_s"] > 0 and r["anchor_s"] > 0
    assert r["prefill_s"] == r["target_s"] + r["draft_s"]
    assert 7 * r["context"] // 8 * 2 <= r["tokens"] <= 2 * r["context"]  # ragged bodies
    assert abs(r["tokens_per_s"] - r["tokens"] / r["prefill_s"]) < 1e-6 * r["tokens_per_s"]
    assert abs(r["anchor_s"] - 3 * r["anchor_layer_s"]) < 1e-9  # the tiny target has 3 layers
  assert (tmp_path / "prefill.png").stat().st_size > 0


def test_memory_estimate_skips_what_does_not_fit():
  # in a subprocess: the script's absl flags would collide with another
  # script's imported by other tests of this process
  code = """
from configs import shapes
from dustin_jax.config import ModelConfig
from scripts.bench_prefill import prefill_bytes
t, d = (ModelConfig.from_hf(dict(c), dtype="bfloat16") for c in shapes.PAIRS["qwen7b"])
print(prefill_bytes(t, d, 16, 32768, 8192, "gpu"), prefill_bytes(t, d, 16, 32768, 8192, "reference"),
      prefill_bytes(t, d, 16, 131072, 8192, "gpu"))
"""
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  kernel, reference, long = map(int, p.stdout.split())
  # weights 16.2 GB, caches 30.1 + 6.4 GB, the target's activations 17.0 GB
  assert 69e9 < kernel < 139 * 2**30  # fits an H200
  tokens = 16 * 32768
  assert reference - kernel == tokens * (2 * 28 * 128 + 2 * 4 * 128) * 4  # the f32 copies
  assert long > 139 * 2**30  # 16 x 128k does not
