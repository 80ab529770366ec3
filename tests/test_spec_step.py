"""The speculative step's parts: the draft phase, distribution-preserving
acceptance, and the bound step (outputs in place, per-step hooks, teacher
forcing, phase names, a mesh). Apart from test_spec.py so that the two
halves can run on two pytest-xdist workers (--dist=loadfile)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dustin_jax.decoding import Model
from dustin_jax.vanilla import generate
from dustin_jax.sampling import SamplingConfig, probs
from dustin_jax.speculative.engine import generate_speculative, init_state
from dustin_jax.speculative.step import SpecConfig, accept, draft_phase
import test_spec
from test_spec import prompts_of

pair = test_spec.pair  # the same tiny pair, built once for this module too


def test_greedy_drafts_are_the_drafts_own_greedy_continuation(pair, rng):
  """Under greedy sampling the draft phase picks tokens from the logits and
  hands back no distribution (greedy acceptance compares tokens)."""
  target, draft = pair
  prompts = prompts_of(rng, [5, 11])
  cfg = SpecConfig(gamma=4)
  st = init_state(target, draft, prompts, max_new_tokens=8, max_len=32, cfg=cfg)
  drafts, q, *_ = draft_phase(draft.graphdef, draft.state, st.draft, st.decode, st.signals, cfg)
  assert q is None
  own, _ = generate(draft, prompts, max_new_tokens=4, max_len=32)
  assert np.asarray(drafts).tolist() == own


def test_bound_step_writes_its_outputs_in_place_and_hands_out_copies(pair, rng):
  """Every result of the compiled step aliases a donated input (no output of
  the step's CUDA graph changes address between launches, see BoundStep),
  the step reuses its own output buffers, and the caller's outputs are
  copies that the next step does not touch."""
  import re
  from dustin_jax.selection.policies import policy_from_config
  from dustin_jax.speculative.step import bind_spec_step
  target, draft = pair
  policy = policy_from_config(dict(policy="dustin", budget=12, n_sink=2, n_window=4, m=3),
                              target.cfg, draft.cfg)
  cfg = SpecConfig(gamma=3, policy=policy, draft_kv="streaming", draft_sink=2, draft_window=4)
  st = init_state(target, draft, prompts_of(rng, [20, 25]), max_new_tokens=16, max_len=48,
                  cfg=cfg)
  step = bind_spec_step(target, draft, cfg)
  hlo = step.lower(st).compile().as_text()
  n_results = len(jax.tree_util.tree_leaves(jax.eval_shape(spec_step_fn_of(target, draft, cfg),
                                                           st)))
  assert len(re.findall(r"\{\d+\}: \(\d+, \{\}, may-alias\)", hlo)) == n_results
  st, out1 = step(st)
  first = jax.tree_util.tree_map(np.asarray, out1)
  slots = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(step._slots[1])]
  st, out2 = step(st)
  assert [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(step._slots[1])] == slots
  jax.tree_util.tree_map(np.testing.assert_array_equal, first,
                         jax.tree_util.tree_map(np.asarray, out1))
  # (meaningful because step 2's outputs differ: the verification set moved on)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(first),
                                                      jax.tree_util.tree_leaves(out2)))
  assert step.compiled_count() == 1


def spec_step_fn_of(target, draft, cfg):
  from dustin_jax.speculative.step import spec_step_fn
  return lambda st: spec_step_fn(target.graphdef, target.state, draft.graphdef, draft.state, st,
                                 cfg)


def test_on_step_hook_sees_every_step_before_the_next_one(pair, rng):
  import numpy as np
  target, draft = pair
  prompts = prompts_of(rng, [7, 11])
  plain, _ = generate_speculative(target, draft, prompts, max_new_tokens=12, max_len=48,
                                  cfg=SpecConfig(gamma=3))
  seen = []
  def hook(st, out):  # reads the state the next step will consume
    seen.append((np.asarray(st.target.lengths), np.asarray(out.n_emitted)))
  hooked, stats = generate_speculative(target, draft, prompts, max_new_tokens=12, max_len=48,
                                       cfg=SpecConfig(gamma=3), on_step=hook)
  assert hooked == plain
  assert len(seen) == stats.steps
  # each step commits exactly what it emits: the lengths after the last
  # step are the prompt rows plus every emitted token
  lengths, _ = seen[-1]
  emitted = sum(n for _, n in seen)
  np.testing.assert_array_equal(lengths, [len(p) - 1 for p in prompts] + emitted)


def _first_token_distribution(p_logits, q_logits, sampling, n, gamma=1, seed=0):
  """Empirical distribution of the first emitted token over n trials."""
  v = p_logits.shape[-1]
  keys = jax.random.split(jax.random.key(seed), n)
  def trial(key):
    k_draft, k_acc = jax.random.split(key)
    q = probs(jnp.broadcast_to(q_logits, (1, gamma, v)), sampling)
    drafts = jax.random.categorical(k_draft, jnp.log(q[0]))[None].astype(jnp.int32)
    tokens, _ = accept(jnp.broadcast_to(p_logits, (1, gamma + 1, v)), q, drafts, k_acc, sampling)
    return tokens[0, :2]
  toks = jax.jit(jax.vmap(trial))(keys)
  return np.asarray(toks)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)])
def test_rejection_sampling_preserves_target_distribution(sampling):
  rng = np.random.default_rng(1)
  v, n = 8, 200_000
  p_logits = jnp.asarray(rng.normal(size=v) * 1.5, jnp.float32)
  q_logits = jnp.asarray(rng.normal(size=v) * 1.5, jnp.float32)
  toks = _first_token_distribution(p_logits, q_logits, sampling, n, gamma=2)
  want = np.asarray(probs(p_logits, sampling))
  got = np.bincount(toks[:, 0], minlength=v) / n
  tv = 0.5 * np.abs(got - want).sum()
  # sampling noise of a TV estimate over 8 bins with 2e5 draws is ~0.003
  assert tv < 0.01, (tv, got, want)
  # the draft distribution alone is far from the target: the test can fail
  q_only = np.asarray(probs(q_logits, sampling))
  assert 0.5 * np.abs(q_only - want).sum() > 0.1


def test_vocab_padding_between_draft_and_target():
  rng = np.random.default_rng(2)
  p_logits = jnp.asarray(rng.normal(size=(1, 3, 12)), jnp.float32)  # target: 12 ids
  q = jax.nn.softmax(jnp.asarray(rng.normal(size=(1, 2, 10)), jnp.float32))  # draft: 10
  tokens, n_acc = accept(p_logits, q, jnp.array([[1, 2]], jnp.int32), jax.random.key(0),
                         SamplingConfig(temperature=1.0))
  assert tokens.shape == (1, 3) and 0 <= int(n_acc[0]) <= 2


def test_teacher_forced_step_scores_the_forced_block(pair, rng):
  """Forcing the target's own greedy continuation: under full verification
  its argmax at every position of each block is the next forced token, and
  the whole block is committed."""
  from dustin_jax.decoding import DecodeStats
  from dustin_jax.loop import decode_loop
  from dustin_jax.speculative.step import StepOptions, bind_spec_step
  target, draft = pair
  gamma, blocks = 3, 3
  prompts = prompts_of(rng, [9, 14])
  ref, _ = generate(target, prompts, max_new_tokens=blocks * (gamma + 1), max_len=64)
  forced = [np.asarray([r[i * (gamma + 1):(i + 1) * (gamma + 1)] for r in ref], np.int32)
            for i in range(blocks)]
  cfg = SpecConfig(gamma=gamma)
  st = init_state(target, draft, prompts, max_new_tokens=blocks * (gamma + 1), max_len=64,
                  cfg=cfg)
  outs = []
  tokens, st = decode_loop(bind_spec_step(target, draft, cfg, StepOptions(teacher_forced=True)),
                           st, DecodeStats(gamma=gamma), inputs=forced, on_output=outs.append)
  assert tokens == ref
  assert len(outs) == blocks
  for i, out in enumerate(outs):
    # position t predicts the token after forced[t]: forced[t + 1], then the next block's first
    nxt = np.concatenate([forced[i][:, 1:], (forced[i + 1][:, :1] if i + 1 < blocks else
                                              np.asarray(ref)[:, -1:] * 0 - 1)], axis=1)
    known = nxt >= 0
    np.testing.assert_array_equal(out.target_top1[known], nxt[known])
    assert np.all(np.isfinite(out.nll)) and np.all(out.nll >= 0)
  np.testing.assert_array_equal(st.target.lengths, [len(p) - 1 + blocks * (gamma + 1)
                                                    for p in prompts])


def test_the_step_names_its_phases_for_the_profiler(pair, rng):
  """Every phase of the fused step is a named scope: the compiled program's
  op names carry them, and the trace attribution maps kernels to them."""
  from dustin_jax.selection.policies import policy_from_config
  from dustin_jax.speculative.step import bind_spec_step
  from scripts.benchmarking import attribute_phases, hlo_phases
  target, draft = pair
  policy = policy_from_config(dict(policy="dustin", budget=12, n_sink=2, n_window=4, m=3),
                              target.cfg, draft.cfg)
  cfg = SpecConfig(gamma=3, policy=policy)
  st = init_state(target, draft, prompts_of(rng, [20, 25]), max_new_tokens=8, max_len=48, cfg=cfg)
  phase_of = hlo_phases(bind_spec_step(target, draft, cfg).lower(st).compile().as_text())
  assert {"draft", "estimate", "select", "verify", "accept", "commit"} <= set(phase_of.values())
  name = next(k for k, v in phase_of.items() if v == "verify")
  events = [dict(name="a_pallas_kernel", ts=0, dur=5), dict(name=name, ts=10, dur=3),
            dict(name="a_pallas_kernel", ts=20, dur=4)]
  # an unknown kernel name takes the phase of the kernel before it on its stream
  assert attribute_phases(events, phase_of) == {"draft": 5, "verify": 7}


def test_bound_step_under_a_mesh_compiles_once(pair, rng):
  """Under a mesh (the CLI always builds one) the shardings XLA propagates
  would drift over the first calls, each drift a recompile of the whole
  step: the bound step pins its placement, so it compiles once."""
  from dustin_jax import sharding
  from dustin_jax.speculative.step import bind_spec_step
  target, draft = pair
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  cfg = SpecConfig(gamma=2, mesh=mesh)
  t = Model(*weights_place(target, mesh))
  d = Model(*weights_place(draft, sharding.draft_mesh(mesh)))
  st = init_state(t, d, prompts_of(rng, [9, 12]), max_new_tokens=12, max_len=40, cfg=cfg)
  step = bind_spec_step(t, d, cfg)
  before = step.compiled_count()
  for _ in range(4):
    st, _ = step(st)
  assert step.compiled_count() == before + 1


def weights_place(model, mesh):
  from dustin_jax.weights import place_model
  return place_model(model.cfg, model.graphdef, model.state, mesh)
