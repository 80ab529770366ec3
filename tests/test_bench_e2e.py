"""scripts/bench_e2e.py writes the promised JSON schema (tiny shapes, CPU)."""

import json

import jax
import pytest
from conftest import xla_flags


def test_bench_e2e_smoke_schema(tmp_path):
  import subprocess
  import sys
  tau = tmp_path / "tau.json"
  tau.write_text(json.dumps([{"policy": "full", "gamma": 2, "budget": 0, "tau": 2.5,
                              "source": "test", "context": 64},
                             {"policy": "dustin", "gamma": 2, "budget": 32, "tau": 2.0},
                             {"policy": "dustin", "gamma": 2, "budget": 32, "tau": 1.75,
                              "draft_kv": "streaming", "draft_sink": 16, "draft_window": 496},
                             {"policy": "dustin", "gamma": 2, "budget": 32, "tau": 1.5,
                              "draft_kv": "streaming", "draft_sink": 16, "draft_window": 2032},
                             {"policy": "dustin", "gamma": 2, "budget": 32, "tau": 1.25,
                              "draft_kv": "streaming", "draft_sink": 16, "draft_window": 2032,
                              "draft_head": "int8"}]))
  # --repeats=2: step_ms is a slope between queues of 2 and 6 steps, each
  # tiny CPU step well under a millisecond: one step's queue is within the noise
  argv = [sys.executable, "-m", "scripts.bench_e2e", "--smoke", "--models=tiny", f"--out_dir={tmp_path}", "--batches=2",
          "--gammas=2", "--repeats=2", "--budget=32", "--n_sink=4", "--n_window=8", "--m=8", f"--tau_json={tau}",
          "--tau_context=64", "--methods=vanilla,sd_full,dustin,dustin_draft",
          "--draft_windows=496,2032", "--draft_heads=native,int8"]
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  recs = json.loads((tmp_path / "e2e.json").read_text())
  assert (tmp_path / "e2e.png").exists()
  keys = {"method", "model", "batch", "context", "gamma", "step_ms", "step_resolved",
          "phase_ms", "tau",
          "tau_source", "tokens_per_s", "speedup_vs_vanilla"}
  assert {r["method"] for r in recs} == {"vanilla", "sd_full", "dustin", "dustin_draft"}
  for r in recs:
    assert not r.get("error"), r
    assert keys <= r.keys() and r["step_ms"] > 0
  sd = next(r for r in recs if r["method"] == "sd_full")
  # per-phase times are GPU kernel time from a trace: none on the CPU
  assert sd["tau"] == 2.5 and (sd["phase_ms"] is None) == (jax.default_backend() == "cpu")
  # the one-signal ablation verifies within the budget; its tau is not in tau.json
  ablation = next(r for r in recs if r["method"] == "dustin_draft")
  assert ablation["budget"] == 32 and ablation["tau"] is None
  assert ablation["tau_source"] == "not measured" and ablation["floor_bytes"]["estimate"] > 0
  # dustin runs a streaming draft cache of 16 + each window's rows: the tau
  # measured with that one prices it; sd_full's draft cache is whole
  # (and that LM head; where no tau of the int8 head is measured, the native's)
  for window, head, tau in ((496, "native", 1.75), (2032, "native", 1.5), (496, "int8", 1.75),
                            (2032, "int8", 1.25)):
    ours = [r for r in recs if r["method"] == "dustin" and r["draft_window"] == window
            and r["draft_head"] == head]
    assert len(ours) == 2 and all(r["tau"] == tau and r["draft_sink"] == 16 for r in ours)
    assert f"streaming draft cache (16 sink + {window}" in ours[0]["tau_source"]
    assert ("native LM head" in ours[0]["tau_source"]) == (head == "int8" and window == 496)
    native_head = next(r for r in recs if r["method"] == "dustin" and r["draft_window"] == window
                       and r["draft_head"] == "native")
    assert ours[0]["floor_bytes"]["draft"] <= native_head["floor_bytes"]["draft"]
  # sd_full: two contexts, each with both heads
  assert sd["draft_window"] is None and len([r for r in recs if r["method"] == "sd_full"]) == 4
  van = next(r for r in recs if r["method"] == "vanilla" and r["context"] == sd["context"])
  assert sd["speedup_vs_vanilla"] == pytest.approx(2.5 * van["step_ms"] / sd["step_ms"])
  assert sd["tokens_per_s"] == pytest.approx(2 * 2.5 / (sd["step_ms"] / 1e3))


def test_bench_e2e_shards_the_step_over_a_mesh(tmp_path):
  """--mesh_model: models and caches sharded by heads (KV heads replicated
  where the model axis needs it: 2 KV heads on 4 devices), on 4 CPU devices."""
  import os
  import subprocess
  import sys
  tau = tmp_path / "tau.json"
  tau.write_text(json.dumps([{"policy": "dustin", "gamma": 2, "budget": 32, "tau": 2.0}]))
  argv = [sys.executable, "-m", "scripts.bench_e2e", "--smoke", "--models=tiny",
          f"--out_dir={tmp_path}", "--batches=2", "--gammas=2", "--repeats=2", "--budget=32",
          "--n_sink=4", "--n_window=8", "--m=8", f"--tau_json={tau}", "--methods=vanilla,dustin",
          "--phase_batches=none", "--mesh_model=4", "--json_name=mesh4.json"]
  env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
  assert p.returncode == 0, p.stderr[-2000:]
  assert (tmp_path / "mesh4.png").exists() and not (tmp_path / "e2e.json").exists()
  recs = json.loads((tmp_path / "mesh4.json").read_text())
  assert {r["method"] for r in recs} == {"vanilla", "dustin"}
  for r in recs:
    assert not r.get("error"), r
    assert r["devices"] == 4 and r["step_ms"] > 0


def test_floor_bytes_hand_computed():
  """Bytes one device must move per step, against hand-computed sums."""
  import types
  from configs import shapes
  from scripts.benchmarking import floor_bytes
  from dustin_jax.config import ModelConfig
  t = ModelConfig.from_hf(dict(shapes.QWEN25_7B))
  d = ModelConfig.from_hf(dict(shapes.QWEN25_05B))
  b, ctx, gamma, budget = 16, 32768, 4, 512
  tw, dw = t.num_params() * 2, d.num_params() * 2
  tkv = 28 * 2 * 4 * 128 * 2  # bytes per token: layers x (k, v) x KV heads x head_dim x bf16
  dkv = 24 * 2 * 2 * 64 * 2
  assert t.kv_bytes_per_token(2) == tkv and d.kv_bytes_per_token(2) == dkv
  assert floor_bytes("vanilla", t, d, b, ctx, gamma, budget, None) == {"verify": tw + tkv * ctx * b}
  # two-way tensor parallel: the target's weights and KV split, the draft whole
  assert floor_bytes("vanilla", t, d, b, ctx, gamma, budget, None, ways=2)["verify"] == (
      (tw + tkv * ctx * b) // 2)
  full = floor_bytes("sd_full", t, d, b, ctx, gamma, budget, None, ways=2)
  assert full == {"draft": gamma * (dw + dkv * ctx * b),
                  "verify": (tw + tkv * (ctx + gamma + 1) * b) // 2}
  # dustin: SpecConfig's 2048-row streaming draft cache, the budget's rows, the SRH keys once
  policy = types.SimpleNamespace(draft_heads=[(3, 0), (3, 13), (5, 2)],  # KV heads 0, 1 of 3; 0 of 5
                                 target_heads=[(7, 1), (7, 27)])  # KV heads 0, 3 of layer 7
  dus = floor_bytes("dustin", t, d, b, ctx, gamma, budget, policy)
  assert dus["draft"] == gamma * (dw + dkv * 2048 * b)
  assert dus["verify"] == tw + tkv * (budget + gamma + 1) * b
  assert dus["estimate"] == 2 * b * ctx * (3 * 64 + 2 * 128)
  # another streaming draft window: its rows, never more than the context
  assert floor_bytes("dustin", t, d, b, ctx, gamma, budget, policy,
                     draft_rows=512)["draft"] == gamma * (dw + dkv * 512 * b)
  assert floor_bytes("dustin", t, d, b, 1000, gamma, budget, policy,
                     draft_rows=2048)["draft"] == gamma * (dw + dkv * 1000 * b)
  # the draft's LM head as int8 rows (151936 x 896) and f32 row scales
  v, h = 151936, 896
  assert floor_bytes("dustin", t, d, b, ctx, gamma, budget, policy, draft_head="int8")[
      "draft"] == gamma * (dw - 2 * v * h + v * h + 4 * v + dkv * 2048 * b)


def test_floor_time_at_the_devices_copy_bandwidth():
  """floor_ms = the floor's bytes at the device's copy bandwidth; its share
  of the step is taken over GPU time where measured; unknown devices get none."""
  from scripts.benchmarking import COPY_TBS, floor_time
  tbs = COPY_TBS["NVIDIA H200"]
  rec = dict(device="NVIDIA H200", floor_bytes={"draft": 1e9, "verify": 3e9}, step_ms=2.0,
             gpu_ms=1.6)
  floor_time(rec)
  assert rec["floor_ms"] == pytest.approx(4e9 / (tbs * 1e9))
  assert rec["floor_share"] == pytest.approx(rec["floor_ms"] / 1.6)
  rec = dict(device="NVIDIA H200", floor_bytes={"verify": 3e9}, step_ms=2.0, gpu_ms=None)
  floor_time(rec)
  assert rec["floor_share"] == pytest.approx(3e9 / (tbs * 1e9) / 2.0)
  assert rec["copy_source"] == "COPY_TBS" and rec["copy_tbs"] == tbs
  cpu = dict(device="cpu", floor_bytes={"verify": 3e9}, step_ms=2.0)
  floor_time(cpu)
  assert "floor_ms" not in cpu and "floor_share" not in cpu
  # a bandwidth measured in the process wins over the table, for any device
  h100 = dict(device="NVIDIA H100 80GB HBM3", floor_bytes={"verify": 3e9}, step_ms=2.0,
              gpu_ms=1.5)
  floor_time(h100, copy_tbs=3.0)
  assert h100["floor_ms"] == pytest.approx(1.0) and h100["floor_share"] == pytest.approx(1 / 1.5)
  assert h100["copy_source"] == "measured" and h100["copy_tbs"] == 3.0


def test_copy_bandwidth_is_none_without_device_kernels():
  """On the CPU the profiler records no GPU kernels: no bandwidth is made up."""
  from scripts.benchmarking import measure_copy_tbs
  assert measure_copy_tbs(gib=2**-10, repeats=1) is None


class FakeClock:
  """`time.perf_counter` for the queue timings: a step advances it by what
  it is told to take, so the tests do not depend on the machine's load."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def fake_steps(monkeypatch, seconds_of_call):
  """(step, calls): `step(carry)` takes `seconds_of_call(i)` on the fake
  clock for its i-th call."""
  import time

  import jax.numpy as jnp
  clock, calls = FakeClock(), []
  monkeypatch.setattr(time, "perf_counter", clock)

  def step(carry):
    clock.now += seconds_of_call(len(calls))
    calls.append(carry)
    return carry + 1, jnp.asarray(carry)
  return step, calls


def test_steady_step_excludes_the_first_dispatch_of_a_queue(monkeypatch):
  """Steps whose queue pays a one-time start (as a device pays the first
  step's dispatch) cost their per-step time in `step`, and that time plus
  the start spread over n steps in `queued`."""
  from scripts.benchmarking import steady_step_count, steady_step_seconds
  per_step, start, n = 0.004, 0.06, 4
  # the first call of each queue (n, then 3n steps, three times) pays the start
  step, calls = fake_steps(
      monkeypatch, lambda i: per_step + (start if i % (4 * n) in (0, n) else 0.0))
  carry, t = steady_step_seconds(step, 0, n)
  assert carry == len(calls) == 3 * 4 * n == steady_step_count(n)
  assert t["resolved"] and t["step"] == pytest.approx(per_step)
  assert t["queued"] == pytest.approx(per_step + start / n)
  # the host's time per step, from the long queue: its start spread over 3n steps
  assert t["host"] == pytest.approx(per_step + start / (3 * n))


def test_steady_step_keeps_each_queue_length_fastest_run(monkeypatch):
  """A queue slowed by noise (here the first short and the second long
  queue) does not move `step`: each length's fastest run is kept, where the
  slope of the first pair alone would come out below zero."""
  from scripts.benchmarking import steady_step_seconds
  per_step, noise, n = 0.004, 0.05, 2  # the first pair's slope: (0.024 - 0.058) / 4 < 0
  slowed = {0, 4 * n + n}  # first calls of the first short and of the second long queue
  step, _ = fake_steps(monkeypatch, lambda i: per_step + (noise if i in slowed else 0.0))
  _, t = steady_step_seconds(step, 0, n)
  assert t["resolved"] and t["step"] == pytest.approx(per_step)


def test_steady_step_hidden_by_noise_is_reported_as_unresolved(monkeypatch):
  """Steps far shorter than the noise (every short queue slowed by more
  than the 2n steps a long one adds) leave no positive slope: `step` is then
  the short queue's mean, an upper bound, and `resolved` is False (never a
  negative step time)."""
  from scripts.benchmarking import steady_step_seconds
  per_step, noise, n = 1e-5, 0.01, 2
  step, _ = fake_steps(  # the first call of each short queue is slowed
      monkeypatch, lambda i: per_step + (noise if i % (4 * n) == 0 else 0.0))
  _, t = steady_step_seconds(step, 0, n)
  assert not t["resolved"]
  assert t["step"] == t["queued"] == pytest.approx(per_step + noise / n)
