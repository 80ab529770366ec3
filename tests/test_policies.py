"""Policies in the real jitted step on tiny random models: a budget covering
the context is lossless, nothing recompiles across steps, and the Oracle's
ARR bounds every other policy's at the same budget."""

import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from dustin_jax.decoding import Model
from dustin_jax.profiling.runtime import evaluate_arr
from dustin_jax.selection.policies import make_policy
from dustin_jax.speculative.engine import generate_speculative
from dustin_jax.speculative.step import SpecConfig, StepOptions, bind_spec_step
from dustin_jax.weights import load_hf_checkpoint
from test_spec import noisy_copy

GAMMA, MAX_LEN, NEW = 3, 48, 12
HEADS = dict(draft_heads=[[1, 0], [2, 3]], target_heads=[[1, 2], [2, 1]])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  t = tmp_path_factory.mktemp("policy_target")
  save_tiny_checkpoint(t, "qwen2", seed=11, num_hidden_layers=3)
  target = Model(*load_hf_checkpoint(str(t), dtype="float32"))
  return target, noisy_copy(target, 0.3)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 97, size=n).tolist() for n in (20, 9)]


@pytest.fixture(scope="module")
def reference(pair, prompts):
  target, draft = pair
  out, _ = generate_speculative(target, draft, prompts, max_new_tokens=NEW, max_len=MAX_LEN,
                                cfg=SpecConfig(gamma=GAMMA))
  return out


def policy(name, pair, budget, n_sink=2, n_window=4, m=None):
  target, draft = pair
  kw = dict(budget=budget)
  if name in ("dustin", "dustin_target", "dustin_draft", "quest"):
    kw.update(n_sink=n_sink, n_window=n_window)
  if name == "dustin":
    kw.update(HEADS, m=m if m is not None else (budget - n_sink - n_window) // 2)
  if name == "dustin_target":
    kw.update(target_heads=HEADS["target_heads"])
  if name == "dustin_draft":
    kw.update(draft_heads=HEADS["draft_heads"])
  if name == "streaming":
    kw.update(n_sink=n_sink)
  return make_policy(name, target_cfg=target.cfg, draft_cfg=draft.cfg, **kw)


@pytest.mark.parametrize("name", ["dustin", "dustin_target", "dustin_draft", "streaming", "quest"])
def test_budget_covering_the_context_is_lossless_and_compiles_once(pair, prompts, reference, name):
  target, draft = pair
  cfg = SpecConfig(gamma=GAMMA, policy=policy(name, pair, budget=MAX_LEN))
  before = bind_spec_step(target, draft, cfg).compiled_count()
  out, stats = generate_speculative(target, draft, prompts, max_new_tokens=NEW,
                                    max_len=MAX_LEN, cfg=cfg)
  assert out == reference
  # the engine's step compiled once over all its steps (and stays cached)
  assert stats.steps >= 3 and bind_spec_step(target, draft, cfg).compiled_count() == before + 1


def test_oracle_with_arr_measured_is_lossless_at_full_budget(pair, prompts, reference):
  target, draft = pair
  cfg = SpecConfig(gamma=GAMMA, policy=policy("oracle", pair, budget=MAX_LEN))
  options = StepOptions(verify="sparse", measure_arr=True)
  before = bind_spec_step(target, draft, cfg, options).compiled_count()
  out, stats, arr = evaluate_arr(target, draft, prompts, max_new_tokens=NEW, max_len=MAX_LEN,
                                 cfg=cfg, verify="sparse")
  assert out == reference
  assert stats.steps >= 3
  assert bind_spec_step(target, draft, cfg, options).compiled_count() == before + 1
  np.testing.assert_allclose(arr.per_step, 1.0, rtol=1e-5)


def test_oracle_runs_in_the_plain_step(pair, prompts, reference):
  """The oracle's full-cache pass comes from its `needs_full_verify`: the
  deployed step runs it without any option."""
  target, draft = pair
  cfg = SpecConfig(gamma=GAMMA, policy=policy("oracle", pair, budget=MAX_LEN))
  out, stats = generate_speculative(target, draft, prompts, max_new_tokens=NEW,
                                    max_len=MAX_LEN, cfg=cfg)
  assert out == reference and stats.steps >= 3


def test_oracle_arr_bounds_every_policy_at_the_same_budget(pair, prompts, reference):
  """Measured on the lossless trajectory (verify="full"), so every policy is
  scored on the same states, step by step."""
  target, draft = pair
  results = {}
  for name in ("oracle", "dustin", "dustin_target", "dustin_draft", "streaming", "quest"):
    cfg = SpecConfig(gamma=GAMMA, policy=policy(name, pair, budget=10))
    out, _, res = evaluate_arr(target, draft, prompts, max_new_tokens=NEW, max_len=MAX_LEN,
                               cfg=cfg, verify="full")
    assert out == reference, name
    assert 0.0 < res.mean < 1.0 and len(res.per_layer) == 3
    results[name] = np.asarray(res.per_step)
  for name, per_step in results.items():
    assert per_step.shape == results["oracle"].shape
    assert np.all(results["oracle"] >= per_step - 1e-6), name
  assert results["oracle"].mean() > results["streaming"].mean()
