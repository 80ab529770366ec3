"""Shared fixtures: tiny random Hugging Face checkpoints written by the tests."""

import importlib.util
import os

# Compiling is most of this suite's time on a CPU: with XLA's LLVM backend at
# -O0 its programs compile about twice as fast (the HLO they run is the same).
# Only where no GPU/TPU plugin is installed, to leave device code as deployed.
_CPU_ONLY = not any(importlib.util.find_spec(m) for m in ("jax_plugins", "libtpu"))
FAST_COMPILE = "--xla_backend_optimization_level=0" if _CPU_ONLY else ""


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's subprocess: `devices` simulated CPU devices (None:
  XLA's default of one) and the fast compile."""
  count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
  return " ".join(f for f in (count, FAST_COMPILE) if f)


def python_path(root: str) -> str:
  """PYTHONPATH for a test's subprocess: the repository first, then what
  the test run itself was given."""
  return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


# Simulated devices for the sharding tests; must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
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


def write_tokenizer_gguf(path, tokens, types, merges, *, model="gpt2", pre="llama-bpe", **extra):
  """A small GGUF file holding a tokenizer (and one tensor): `extra` keys
  name GGUFWriter `add_<key>` calls."""
  import gguf

  w = gguf.GGUFWriter(str(path), arch="llama")
  w.add_context_length(128)
  w.add_embedding_length(8)
  w.add_block_count(1)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model(model)
  if pre is not None:
    w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  if merges:
    w.add_token_merges(merges)
  for key, value in extra.items():
    getattr(w, "add_" + key)(value)
  w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
