"""Checkpoint loading: names and shapes checked, orbax round trip, bad input."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import save_tiny_checkpoint
from dustin_jax.config import ConfigError, ModelConfig
from dustin_jax.weights import (CheckpointError, hf_tensors_from_params, load_checkpoint,
                                load_hf_checkpoint, save_params)


def _pure(state):
  return jax.tree_util.tree_leaves(nnx.to_pure_dict(state))


def test_loaded_params_equal_hf_tensors(tiny_qwen):
  path, hf = tiny_qwen
  cfg, _, state = load_hf_checkpoint(path, dtype="float32")
  ours = hf_tensors_from_params(cfg, state)
  theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
  theirs.pop("lm_head.weight")  # tied to the embedding in this config
  assert cfg.tie_embeddings and set(ours) == set(theirs)
  for name, arr in theirs.items():
    np.testing.assert_array_equal(ours[name], arr, err_msg=name)


def test_sharded_checkpoint_with_index(tmp_path, rng):
  save_tiny_checkpoint(tmp_path, "llama", seed=5, max_shard_size="60KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  _, _, state = load_hf_checkpoint(str(tmp_path), dtype="float32")
  single = tmp_path.parent / "single"
  save_tiny_checkpoint(single, "llama", seed=5)
  _, _, ref = load_hf_checkpoint(str(single), dtype="float32")
  for a, b in zip(_pure(state), _pure(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_round_trip(tiny_llama, tmp_path):
  cfg, _, state = load_hf_checkpoint(tiny_llama[0], dtype="bfloat16")
  save_params(str(tmp_path / "ckpt"), cfg, state)
  cfg2, _, state2 = load_checkpoint(str(tmp_path / "ckpt"))
  assert cfg2 == cfg
  a, b = _pure(state), _pure(state2)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _edit_checkpoint(src, dst, edit):
  from safetensors.numpy import load_file, save_file
  shutil.copytree(src, dst)
  f = os.path.join(dst, "model.safetensors")
  tensors = load_file(f)
  edit(tensors)
  save_file(tensors, f)


def test_missing_tensor_names_itself(tiny_llama, tmp_path):
  name = "model.layers.1.self_attn.k_proj.weight"
  _edit_checkpoint(tiny_llama[0], tmp_path / "c", lambda t: t.pop(name))
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
    load_hf_checkpoint(str(tmp_path / "c"))


def test_misshaped_tensor_names_itself(tiny_llama, tmp_path):
  name = "model.layers.2.mlp.up_proj.weight"
  def edit(t):
    t[name] = t[name][:-1]
  _edit_checkpoint(tiny_llama[0], tmp_path / "c", edit)
  with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' has shape \(95, 64\), expected \(96, 64\)"):
    load_hf_checkpoint(str(tmp_path / "c"))


def test_unsupported_architecture(tmp_path):
  with pytest.raises(ConfigError, match="unsupported architecture model_type='gemma3'"):
    ModelConfig.from_hf({"model_type": "gemma3", "hidden_size": 64})
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
  with pytest.raises(ConfigError, match="unsupported architecture model_type='mistral'"):
    load_hf_checkpoint(str(tmp_path))


def test_unsupported_features_refused():
  from conftest import tiny_hf_config
  with pytest.raises(ConfigError, match="use_sliding_window"):
    ModelConfig.from_hf(tiny_hf_config("qwen2", use_sliding_window=True))
  with pytest.raises(ConfigError, match="unsupported rope type 'longrope'"):
    ModelConfig.from_hf(tiny_hf_config("llama", rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
        "original_max_position_embeddings": 256}))


def test_missing_checkpoint_directory(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    load_hf_checkpoint(str(tmp_path / "nope"))


@pytest.mark.parametrize("name", ["QWEN25_05B", "QWEN25_7B", "QWEN25_72B", "LLAMA3_8B",
                                  "LLAMA32_1B"])
def test_config_dicts_read_as_transformers_reads_them(name):
  """A config dict (read without transformers) gives the ModelConfig that
  transformers' own parse of it gives, also with every optional field left
  to its default."""
  from transformers import AutoConfig
  from configs import shapes
  full = dict(getattr(shapes, name))
  required = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
  for d in (full, {k: full[k] for k in required}):
    rest = {k: v for k, v in d.items() if k != "model_type"}
    theirs = ModelConfig.from_hf(AutoConfig.for_model(d["model_type"], **rest))
    assert ModelConfig.from_hf(d) == theirs
