"""Vanilla decoding: equals transformers' greedy generate; clear input errors."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dustin_jax.decoding import DecodeState, InputError, Model, emit
from dustin_jax.vanilla import generate
from dustin_jax.sampling import SamplingConfig, next_tokens, probs
from dustin_jax.weights import load_hf_checkpoint


def hf_greedy(hf, prompt, n):
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      min_new_tokens=n, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_greedy_generate_matches_transformers_ragged(tiny_llama, rng):
  path, hf = tiny_llama
  model = Model(*load_hf_checkpoint(path, dtype="float32"))
  prompts = [rng.integers(0, 97, size=n).tolist() for n in (9, 3, 14)]
  ours, stats = generate(model, prompts, max_new_tokens=12, max_len=40, token_block=8)
  assert stats.tokens == 36 and stats.tau == 1.0
  for p, o in zip(prompts, ours):
    assert o == hf_greedy(hf, p, 12)


def test_prompt_longer_than_cache_is_refused(tiny_llama):
  model = Model(*load_hf_checkpoint(tiny_llama[0], dtype="float32"))
  with pytest.raises(InputError, match="max_len is 16"):
    generate(model, [[1] * 20], max_new_tokens=2, max_len=16)


def test_emit_stops_at_eos_and_budget():
  import dataclasses
  ds = DecodeState.init([[3, 0], [3, 0], [3, 0]], [10, 2, 10], None)
  ds = dataclasses.replace(ds, done=ds.done.at[2].set(True))
  toks = jnp.array([[5, 7, 9, 4], [5, 6, 8, 1], [1, 2, 3, 4]])
  ds, out, n = emit(ds, toks, jnp.array([4, 4, 4]), eos_ids=(7,))
  np.testing.assert_array_equal(n, [2, 2, 0])  # EOS kept; budget of 2; finished
  np.testing.assert_array_equal(out[0], [5, 7, -1, -1])
  np.testing.assert_array_equal(ds.done, [True, True, True])
  np.testing.assert_array_equal(ds.pending, [7, 6, 0])
  np.testing.assert_array_equal(ds.prev, [5, 5, 3])


def test_sampling_config_rejects_bad_values():
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=-1.0)


def test_next_tokens_greedy_is_the_argmax_without_a_distribution():
  import jax
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 40)), jnp.bfloat16)
  tok, p = next_tokens(jax.random.key(0), logits, SamplingConfig())
  assert p is None and tok.dtype == jnp.int32
  assert np.asarray(tok).tolist() == np.argmax(np.asarray(logits, np.float32), -1).tolist()
  # sampling: a draw from probs() (top_k = 1 leaves one token), the distribution returned
  cfg = SamplingConfig(temperature=0.7, top_k=1)
  tok, p = next_tokens(jax.random.key(1), logits, cfg)
  np.testing.assert_array_equal(np.asarray(p), np.asarray(probs(logits, cfg)))
  assert np.asarray(tok).tolist() == np.argmax(np.asarray(logits, np.float32), -1).tolist()


def test_bound_step_compiles_once_and_binds_its_params(tiny_llama, rng):
  import jax
  from dustin_jax.vanilla import bind_vanilla_step
  model = Model(*load_hf_checkpoint(tiny_llama[0], dtype="float32"))
  prompts = [rng.integers(0, 97, size=n).tolist() for n in (5, 8)]
  step = bind_vanilla_step(model, sampling=SamplingConfig())
  before = step.compiled_count()
  first, _ = generate(model, prompts, max_new_tokens=6, max_len=24, token_block=8)
  again, _ = generate(model, prompts, max_new_tokens=6, max_len=24, token_block=8)
  assert again == first
  # both calls (and all their steps) ran one executable, compiled once
  assert step.compiled_count() == before + 1
  # the params are bound when binding: other params, other tokens
  zeroed = Model(model.cfg, model.graphdef,
                 jax.tree_util.tree_map(lambda x: x * 0.5, model.state))
  other, _ = generate(zeroed, prompts, max_new_tokens=6, max_len=24, token_block=8)
  assert other != first
