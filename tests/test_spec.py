"""The speculative step end to end: lossless greedy, rollback, stop control,
draft cache modes (its parts, acceptance and the bound step:
test_spec_step.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from dustin_jax.cache import KVCache
from dustin_jax.decoding import InputError, Model
from dustin_jax.vanilla import generate
from dustin_jax.speculative.engine import generate_speculative, init_state
from dustin_jax.speculative.step import SpecConfig, spec_step
from dustin_jax.weights import load_hf_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """A tiny target and a tiny draft that agree often enough to accept some
  tokens: the draft is the target with noise added to its weights."""
  t = tmp_path_factory.mktemp("target")
  save_tiny_checkpoint(t, "qwen2", seed=11, num_hidden_layers=3)
  target = Model(*load_hf_checkpoint(str(t), dtype="float32"))
  return target, noisy_copy(target, 0.3)


def noisy_copy(model, scale, seed=0):
  leaves, tree = jax.tree_util.tree_flatten(model.state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return Model(model.cfg, model.graphdef, jax.tree_util.tree_unflatten(tree, noisy))


def prompts_of(rng, lens):
  return [rng.integers(0, 97, size=n).tolist() for n in lens]


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_speculative_equals_greedy_vanilla(pair, gamma, rng):
  target, draft = pair
  prompts = prompts_of(rng, [7, 2, 19])
  ref, _ = generate(target, prompts, max_new_tokens=20, max_len=64)
  ours, stats = generate_speculative(target, draft, prompts, max_new_tokens=20, max_len=64,
                                     cfg=SpecConfig(gamma=gamma))
  assert ours == ref
  assert stats.tokens == 60 and 1.0 <= stats.tau <= gamma + 1
  if gamma > 1:
    assert stats.accepted > 0, "the noisy draft should agree with the target sometimes"


@pytest.mark.parametrize("mode", ["kernel", "kernel_prefetch", "seam", "seam_mosaic"])
def test_greedy_speculative_with_one_kernel_draft_mlps_equals_greedy_vanilla(
    tmp_path, rng, mode):
  """A draft whose MLPs run as kernels.swiglu_mlp, with or without the next
  layer's L2 prefetches, or whose seams between attentions run as
  kernels.layer_seam, with the Triton or the Mosaic window attention (on a
  Hopper GPU; their references elsewhere), keeps greedy speculative
  decoding lossless."""
  # head_dim 64: the seam_mosaic draft's attention kernel takes it
  save_tiny_checkpoint(tmp_path, "qwen2", seed=5, num_hidden_layers=2, hidden_size=128,
                       intermediate_size=128, num_attention_heads=2)
  target = Model(*load_hf_checkpoint(str(tmp_path), dtype="bfloat16"))
  noisy = jax.tree.map(lambda n, w: n.astype(w.dtype), noisy_copy(target, 0.3).state,
                       target.state)
  draft = Model(target.cfg, target.graphdef, noisy).with_folded_norms().with_draft_mlp(mode)
  prompts = prompts_of(rng, [9, 4])
  ref, _ = generate(target, prompts, max_new_tokens=12, max_len=48)
  ours, _ = generate_speculative(target, draft, prompts, max_new_tokens=12, max_len=48,
                                 cfg=SpecConfig(gamma=4, draft_kv="streaming", draft_sink=4,
                                                draft_window=8))
  assert ours == ref


def test_greedy_speculative_with_int8_draft_head_equals_greedy_vanilla(pair, rng):
  """A draft whose LM head is int8 rows (`with_draft_head("int8")`) only
  proposes: the target's verification keeps the output its own."""
  target, draft = pair
  draft = draft.with_draft_head("int8")
  prompts = prompts_of(rng, [7, 2, 19])
  ref, _ = generate(target, prompts, max_new_tokens=20, max_len=64)
  ours, stats = generate_speculative(target, draft, prompts, max_new_tokens=20, max_len=64,
                                     cfg=SpecConfig(gamma=4))
  assert ours == ref
  assert stats.accepted > 0


def test_streaming_draft_is_still_lossless(pair, rng):
  target, draft = pair
  prompts = prompts_of(rng, [30, 12])
  ref, _ = generate(target, prompts, max_new_tokens=16, max_len=64)
  cfg = SpecConfig(gamma=3, draft_kv="streaming", draft_sink=2, draft_window=6)
  ours, stats = generate_speculative(target, draft, prompts, max_new_tokens=16, max_len=64, cfg=cfg)
  assert ours == ref


def test_self_draft_accepts_everything(pair, rng):
  target, _ = pair
  prompts = prompts_of(rng, [5, 9])
  ours, stats = generate_speculative(target, target, prompts, max_new_tokens=15, max_len=48,
                                     cfg=SpecConfig(gamma=4))
  assert stats.acceptance_rate == 1.0 and stats.steps == 3


def test_eos_and_max_new_per_sequence(pair, rng):
  target, draft = pair
  prompts = prompts_of(rng, [6, 6])
  ref, _ = generate(target, prompts, max_new_tokens=12, max_len=40)
  eos = ref[0][4]  # a token the first sequence emits 5th
  cut = ref[0].index(eos) + 1
  ours, _ = generate_speculative(target, draft, prompts, max_new_tokens=12, max_len=40,
                                 cfg=SpecConfig(gamma=3, eos_ids=(eos,)))
  assert ours[0] == ref[0][:cut]
  assert eos not in ours[1][:-1]
  ref1 = ref[1][:ref[1].index(eos) + 1] if eos in ref[1] else ref[1]
  assert ours[1] == ref1


def test_rollback_after_rejections_matches_clean_cache(pair, rng):
  target, _ = pair
  draft = noisy_copy(target, 3.0, seed=1)  # a poor draft: rejections are certain
  prompts = prompts_of(rng, [10, 10])
  cfg = SpecConfig(gamma=6)
  st = init_state(target, draft, prompts, max_new_tokens=20, max_len=48, cfg=cfg)
  st, out = spec_step(target.graphdef, target.state, draft.graphdef, draft.state, st, cfg=cfg)
  n_acc = np.asarray(out.n_accepted)
  assert np.any(n_acc < 6), "need a rejection for this test"
  emitted = [list(np.asarray(out.tokens[i])[:int(out.n_emitted[i])]) for i in range(2)]
  # next logits from the speculative caches vs a cache built from accepted tokens only
  from flax import nnx
  def next_logits(model, cache, tok):
    m = nnx.merge(model.graphdef, model.state)
    h, _, _ = m(jnp.asarray(tok)[:, None], cache)
    return np.asarray(m.logits(h[:, 0]))
  pending = np.asarray(st.decode.pending)
  for model, cache in ((target, st.target), (draft, st.draft)):
    got = next_logits(model, jax.tree_util.tree_map(jnp.copy, cache), pending)
    for i in range(2):
      clean_tokens = prompts[i] + emitted[i]
      c = KVCache.init(model.cfg, 1, 48)
      m = nnx.merge(model.graphdef, model.state)
      _, c, _ = m(jnp.asarray([clean_tokens[:-1]]), c)
      c = c.commit(jnp.asarray([len(clean_tokens) - 1]))
      assert int(cache.lengths[i]) == len(clean_tokens) - 1
      want = next_logits(model, c, np.asarray([clean_tokens[-1]]))[0]
      if model is target:  # the draft's last row may be rewritten next step
        np.testing.assert_allclose(got[i], want, atol=1e-4)


def test_bad_inputs(pair):
  target, draft = pair
  with pytest.raises(ValueError, match="gamma must be >= 1"):
    SpecConfig(gamma=0)
  with pytest.raises(InputError, match="at least 2 tokens"):
    generate_speculative(target, draft, [[5]], max_new_tokens=4, max_len=32)
  with pytest.raises(InputError, match="max_len is 16"):
    generate_speculative(target, draft, [[5] * 10], max_new_tokens=4, max_len=16)
  # a draft of another tokenizer: vocabularies that differ by more than padding
  other = Model(dataclasses.replace(draft.cfg, vocab_size=2 * target.cfg.vocab_size),
                draft.graphdef, draft.state)
  with pytest.raises(InputError, match="do not share a tokenizer"):
    generate_speculative(target, other, [[5] * 4], max_new_tokens=4, max_len=32)
