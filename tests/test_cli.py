"""scripts.decode: a run on tiny random models, and one clear error per bad config."""

import json
import os
import subprocess
import sys

import pytest


def test_decode_tiny_writes_json(tmp_path, capsys):
  from configs import tiny
  from scripts.decode import print_result, run
  c = tiny.get_config()
  c.dustin.policy = "dustin"
  r = run(c)
  print_result(r)
  out = capsys.readouterr().out
  assert "tokens/s" in out and "tau" in out and "time per phase" in out
  assert len(r["sequences"]) == c.batch_size
  assert all(len(s["tokens"]) == c.max_new_tokens for s in r["sequences"])
  assert set(r["phase_ms"]) == {"draft", "select", "verify", "commit"}
  assert 1.0 <= r["stats"]["tau"] <= c.gamma + 1
  json.dumps(r)  # serialisable as written by --config.output_json


def _cli(*overrides):
  p = subprocess.run([sys.executable, "-m", "scripts.decode", "--config=configs/tiny.py",
                      *overrides], capture_output=True, text=True, timeout=300)
  return p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


@pytest.mark.parametrize("override,message", [
    ("--config.gamma=0", "gamma must be >= 1"),
    ("--config.dustin.polcy=dustin", 'Did you mean "policy"'),
    ("--config.dustin.budget=8", "dustin.budget=8 is smaller than"),
    ("--config.mem_fraction=1.5", "mem_fraction=1.5 must be in (0, 1]"),
])
def test_bad_config_fails_with_one_clear_message(override, message):
  args = [override] + (["--config.dustin.policy=dustin"] if "budget" in override else [])
  code, last = _cli(*args)
  assert code != 0 and message in last and last.startswith("error:")


def test_xla_flags_reach_xla(tmp_path):
  dump = tmp_path / "dump"
  code, last = _cli(f"--config.xla_flags=--xla_dump_to={dump}", "--config.method=vanilla",
                    "--config.time_phases=False", "--config.max_new_tokens=2",
                    "--config.progress=False")
  assert code == 0, last
  assert any(f.name.endswith(".txt") for f in dump.iterdir())  # XLA dumped the programs


def test_missing_checkpoint(tmp_path):
  code, last = _cli("--config.random_weights=False", f"--config.target.checkpoint={tmp_path}/x",
                    f"--config.draft.checkpoint={tmp_path}/y", "--config.prompt=hi")
  assert code != 0 and "does not exist" in last


def test_vanilla_method_ignores_the_policy():
  from configs import tiny
  from scripts.decode import run
  c = tiny.get_config()
  c.method, c.dustin.policy, c.time_phases = "vanilla", "dustin", False
  r = run(c)
  assert r["stats"]["tau"] == 1.0 and all(len(s["tokens"]) == c.max_new_tokens
                                          for s in r["sequences"])


@pytest.mark.parametrize("jaxlib, preset, extra, want", [
    ((0, 11, 2), "", "--a=1", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP --a=1"),
    ((0, 12, 0), "--b=2", "", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP --b=2"),
    ((0, 10, 2), "--b=2", "--a=1", "--b=2 --a=1"),  # an older jaxlib rejects the flag
    ((0, 11, 2), "", "--xla_gpu_command_buffer_update_mode=X",
     "--xla_gpu_command_buffer_update_mode=X"),  # a mode set already wins
])
def test_append_xla_flags_adds_the_stable_graph_mode_where_jaxlib_knows_it(
    monkeypatch, jaxlib, preset, extra, want):
  from dustin_jax import config
  monkeypatch.setattr(config, "_jaxlib_version", lambda: jaxlib)
  monkeypatch.setenv("XLA_FLAGS", preset)
  config.append_xla_flags(extra)
  assert os.environ["XLA_FLAGS"] == want


def test_this_jaxlib_version_is_read():
  import jax
  from dustin_jax import config
  assert config._jaxlib_version()[:2] == tuple(int(x) for x in jax.__version__.split(".")[:2])


def test_tokenizer_larger_than_the_model_vocab_is_refused(tiny_llama, tmp_path):
  import shutil
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  src, _ = tiny_llama  # a checkpoint of vocab_size 97
  ckpt = tmp_path / "ckpt"
  shutil.copytree(src, ckpt)
  words = {f"w{i}": i for i in range(200)}
  words["[UNK]"] = 200
  tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(ckpt)
  code, last = _cli("--config.random_weights=False", f"--config.target.checkpoint={ckpt}",
                    f"--config.draft.checkpoint={ckpt}", "--config.prompt=w1 w2 w3",
                    "--config.progress=False")
  assert code != 0 and last.startswith("error:"), last
  assert "vocab_size=97 is smaller than the tokenizer's 201 tokens" in last
