"""Shared fixtures: tiny random Hugging Face checkpoints written by the tests."""

import os

# Simulated devices for the sharding tests; must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_hf_config(model_type: str, **overrides):
  from transformers import AutoConfig
  kw = dict(TINY)
  if model_type == "qwen2":
    kw.update(rope_theta=1e6, tie_word_embeddings=True)
  kw.update(overrides)
  return AutoConfig.for_model(model_type, **kw)


def save_tiny_checkpoint(path, model_type: str, seed: int = 0, max_shard_size="2GB",
                         **overrides):
  """A random-initialised transformers model saved with `save_pretrained`."""
  import torch
  from transformers import AutoModelForCausalLM
  torch.manual_seed(seed)
  cfg = tiny_hf_config(model_type, **overrides)
  model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
  with torch.no_grad():  # non-trivial norms and biases, so a missed one shows
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.1 * torch.randn_like(p))
      if name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
  model.save_pretrained(path, max_shard_size=max_shard_size)
  return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_llama")
  return str(path), save_tiny_checkpoint(path, "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_qwen")
  return str(path), save_tiny_checkpoint(path, "qwen2", seed=2)


@pytest.fixture
def rng():
  return np.random.default_rng(0)
