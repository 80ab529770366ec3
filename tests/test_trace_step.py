"""scripts/trace_step on CPU: the sharded path runs and its JSON holds both steps."""

import json
import os
import subprocess
import sys

import pytest
from conftest import xla_flags


# a subprocess that compiles and profiles both steps twice over a mesh: ~1 min on 2 cores
@pytest.mark.slow
def test_trace_step_profiles_both_steps_over_a_mesh(tmp_path):
  argv = [sys.executable, "-m", "scripts.trace_step", "--smoke", "--mesh_model=2",
          f"--out_dir={tmp_path}", "--asrun_steps=2", "--steps=1"]
  env = dict(os.environ, XLA_FLAGS=xla_flags(2), JAX_PLATFORMS="cpu")
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads((tmp_path / "trace_step.json").read_text())
  assert out["devices"] == 2 and out["model"] == "qwen7b"
  for method in ("vanilla", "dustin"):
    assert out[method]["step_ms"] > 0
    # the sharded target all-reduces: the host events of the trace show them
    assert any("all-reduce" in e["event"] for e in out[method]["host"])


HLO = """HloModule jit_step

ENTRY %main {
  %fusion.3 = f32[4]{0} fusion(%p0), kind=kLoop, calls=%f, metadata={op_name="jit(step)/draft/add" stack_frame_id=3}
  %gemm_fusion_dot.7 = f32[4]{0} fusion(%p1), kind=kCustom, metadata={op_name="jit(step)/verify/dot_general" stack_frame_id=1}
  ROOT %copy.1 = f32[4]{0} copy(%fusion.3), metadata={op_name="jit(step)/commit/copy"}
}

FileNames
1 "/src/dustin_jax/models/decoder.py"
2 "/src/dustin_jax/speculative/step.py"

FunctionNames
1 "Block.finish"
2 "RMSNorm.__call__"
3 "draft_phase"

FileLocations
1 {file_name_id=2 function_name_id=3 line=148 end_line=148 column=1 end_column=2}
2 {file_name_id=1 function_name_id=1 line=241 end_line=241 column=1 end_column=2}
3 {file_name_id=1 function_name_id=2 line=131 end_line=131 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
"""


def test_hlo_op_names_name_each_kernel_with_its_code():
  from scripts.benchmarking import hlo_op_names, hlo_phases
  names = hlo_op_names(HLO)
  # frame 3's parent is frame 2 (the printer writes parent id + 1)
  assert names["fusion_3"] == ("jit(step)/draft/add @ RMSNorm.__call__ decoder.py:131 "
                               "< Block.finish decoder.py:241")
  assert names["gemm_fusion_dot_7"] == "jit(step)/verify/dot_general @ draft_phase step.py:148"
  assert names["copy_1"] == "jit(step)/commit/copy"
  assert hlo_phases(HLO) == {"fusion_3": "draft", "gemm_fusion_dot_7": "verify",
                             "copy_1": "commit"}


def test_kernel_sources_and_time_by_source():
  from scripts.benchmarking import hlo_op_names, short_source, time_by_source
  names = hlo_op_names(HLO)
  assert short_source(names["fusion_3"]) == ("draft/add @ RMSNorm.__call__ decoder.py:131 "
                                             "< Block.finish decoder.py:241")
  per = {"fusion_3": 3.0, "fusion_3_again": 0.0, "gemm_fusion_dot_7": 10.0, "my_pallas": 4.0}
  count = {"fusion_3": 2, "fusion_3_again": 0, "gemm_fusion_dot_7": 1, "my_pallas": 1}
  names["fusion_3_again"] = names["fusion_3"]
  assert time_by_source(per, count, names) == [
      dict(source="draft_phase", us=10.0, launches=1),
      dict(source="my_pallas", us=4.0, launches=1),
      dict(source="RMSNorm.__call__ < Block.finish", us=3.0, launches=2)]


def test_trace_step_saves_the_compiled_hlo(tmp_path):
  import gzip
  argv = [sys.executable, "-m", "scripts.trace_step", "--smoke", "--methods=dustin",
          "--save_hlo", "--timeline", f"--out_dir={tmp_path}", "--asrun_steps=1", "--steps=1"]
  p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-2000:]
  text = gzip.open(tmp_path / "trace_step.json.hlo.txt.gz", "rt").read()
  assert text.startswith("HloModule") and "StackFrames" in text
  out = json.loads((tmp_path / "trace_step.json").read_text())
  assert "vanilla" not in out and out["dustin"]["step_ms"] > 0
  # the kernel timeline (empty on CPU: no GPU streams) and its plot
  rows = json.load(gzip.open(tmp_path / "trace_step.json.timeline.json.gz", "rt"))
  assert isinstance(rows, list)
  assert (tmp_path / "trace_step.json.timeline.png").stat().st_size > 1000


def test_timeline_lists_kernels_in_start_order_with_their_phase():
  from scripts.benchmarking import timeline
  dev = [dict(ts=110.0, dur=5.0, tid=7, name="gemm_fusion_dot_7"),
         dict(ts=100.0, dur=12.5, tid=7, name="fusion_3"),
         dict(ts=104.0, dur=1.0, tid=8, name="my_pallas")]
  phase_of = {"fusion_3": "draft", "gemm_fusion_dot_7": "verify"}
  assert timeline(dev, phase_of) == [[0.0, 12.5, 7, "fusion_3", "draft"],
                                     [4.0, 1.0, 8, "my_pallas", None],
                                     [10.0, 5.0, 7, "gemm_fusion_dot_7", "verify"]]
  assert timeline([], phase_of) == []


def test_row_phases_name_pallas_kernels_and_plot_the_timeline(tmp_path):
  from scripts.benchmarking import plot_timeline, row_phases
  rows = [[0.0, 5.0, 7, "fusion_3", "draft"],
          [1.0, 9.0, 8, "srh_logits__1", None],       # named: estimate
          [6.0, 4.0, 7, "window_attention", None],    # its stream's last: draft
          [7.0, 2.0, 9, "my_kernel", None],           # first on its stream: the last started
          [11.0, 3.0, 8, "topk_chunks", None],         # named: select
          [12.0, 1.0, 8, "gemm_fusion_dot_7", "verify"],
          [15.0, 1.0, 8, "listed_attention", None]]
  assert row_phases(rows) == ["draft", "estimate", "draft", "draft", "select", "verify",
                              "verify"]
  plot_timeline(rows, str(tmp_path / "t.png"), "t")
  assert (tmp_path / "t.png").stat().st_size > 5000
