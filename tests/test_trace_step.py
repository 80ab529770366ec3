"""scripts/trace_step on CPU: the sharded path runs and its JSON holds both steps."""

import json
import os
import subprocess
import sys


def test_trace_step_profiles_both_steps_over_a_mesh(tmp_path):
  argv = [sys.executable, "-m", "scripts.trace_step", "--smoke", "--mesh_model=2",
          f"--out_dir={tmp_path}", "--asrun_steps=2", "--steps=1"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads((tmp_path / "trace_step.json").read_text())
  assert out["devices"] == 2 and out["model"] == "qwen7b"
  for method in ("vanilla", "dustin"):
    assert out[method]["step_ms"] > 0 and len(out[method]["step_ms_runs"]) == 3
    # the sharded target all-reduces: the host events of the trace show them
    assert any("all-reduce" in e["event"] for e in out[method]["host"])
