"""Signals: the target-historical signal is one step old, the draft signal is
reset per step, only the configured heads are read, Quest metadata covers
committed rows only, the attention weights behind ARR and the Oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dustin_jax.cache import KVCache
from dustin_jax.selection import signals as sig
from dustin_jax.selection.arr import arr_of_indices
from dustin_jax.selection.policies import Dustin, DustinTarget, Oracle, Quest
from kernels.srh_scores.ops import srh_scores

B, HQ, HKV, D, S = 1, 4, 2, 8, 32


def make_cache(rng, layers, lengths, s=S, dtype=jnp.float32):
  k = tuple(jnp.asarray(rng.normal(size=(len(lengths), HKV, s, D)) * 0.1, dtype)
            for _ in range(layers))
  return KVCache(k=k, v=k, lengths=jnp.asarray(lengths, jnp.int32))


def set_key(cache, layer, kv_head, pos, vec):
  k = cache.k[layer].at[:, kv_head, pos].set(vec)
  return cache.with_layer(layer, k, k)


def queries_toward(rng, vec, t, head, layers=2):
  """taps {layer: [B, t, HQ, D]}: small noise, `head` pointing at `vec`."""
  out = {}
  for layer in range(layers):
    q = rng.normal(size=(B, t, HQ, D)) * 0.1
    q[:, :, head] = 6.0 * vec
    out[layer] = jnp.asarray(q, jnp.float32)
  return out


def test_target_signal_used_at_step_t_is_the_one_of_step_t_minus_1():
  rng = np.random.default_rng(0)
  gamma = 3
  pol = DustinTarget(budget=3, n_sink=1, n_window=1, target_heads=((1, 2),))  # head 2 -> kv 1
  u, v = np.eye(D)[0] * 3, np.eye(D)[1] * 3
  cache = make_cache(rng, 2, [12])
  cache = set_key(set_key(cache, 1, 1, 5, u), 1, 1, 9, v)
  signals = pol.init(B, S)
  # step t-1: verify queries look at row 5
  taps1 = queries_toward(rng, u, gamma + 1, head=2)
  signals = pol.observe_target(signals, taps1, cache, gamma)
  want = srh_scores(taps1[1][:, :, 2:3], cache.k[1], cache.lengths, (1,))
  np.testing.assert_allclose(signals["target"], want, rtol=1e-6)
  # step t (2 rows committed since): select reads the t-1 signal -> row 5
  cache_t = cache.with_lengths(jnp.asarray([14]))
  assert list(np.asarray(pol.select(signals, cache_t, gamma))[0]) == [0, 5, 13]
  # the verify of step t looks at row 9: the signal is replaced, not accumulated,
  # and it is the NEXT select that follows it
  taps2 = queries_toward(rng, v, gamma + 1, head=2)
  signals = pol.observe_target(signals, taps2, cache_t, gamma)
  want2 = srh_scores(taps2[1][:, :, 2:3], cache.k[1], cache_t.lengths, (1,))
  np.testing.assert_allclose(signals["target"], want2, rtol=1e-6)
  cache_t1 = cache_t.with_lengths(jnp.asarray([15]))
  assert list(np.asarray(pol.select(signals, cache_t1, gamma))[0]) == [0, 9, 14]


def test_draft_signal_sums_the_steps_queries_each_causally_and_is_replaced():
  rng = np.random.default_rng(1)
  pol = Dustin(budget=8, n_sink=1, n_window=1, m=6, draft_heads=((0, 1), (1, 3)),
               target_heads=())
  assert pol.draft_tap_layers == (0, 1) and pol.target_tap_layers == ()
  cache = make_cache(rng, 2, [10])
  signals = pol.init(B, S)
  # the gamma = 3 lookahead queries of one step, query i at position 10 + i,
  # scored in one call: the sum of scoring each alone over the keys it sees
  taps = {l: jnp.asarray(rng.normal(size=(B, 3, HQ, D)), jnp.float32) for l in (0, 1)}
  signals = jax.jit(pol.observe_draft)(signals, taps, cache)
  want = 0.0
  for i in range(3):
    c = cache.with_lengths(jnp.asarray([10 + i]))
    one = lambda l, h, g: srh_scores(taps[l][:, i:i + 1, h:h + 1], c.k[l], c.lengths, (g,))
    want = want + one(0, 1, 0) + one(1, 3, 1)
  np.testing.assert_allclose(signals["draft"], want, rtol=1e-5)
  assert float(signals["draft"].sum()) == pytest.approx(3 * 2, rel=1e-4)  # 2 heads x 3 queries
  assert float(signals["draft"][0, 13:].sum()) == 0.0  # nothing past the last query's key
  taps = {l: jnp.asarray(rng.normal(size=(B, 1, HQ, D)), jnp.float32) for l in (0, 1)}
  signals = pol.observe_draft(signals, taps, cache)   # next step: replaced
  assert float(signals["draft"].sum()) == pytest.approx(2, rel=1e-4)


def _cost(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  dots = str(jax.make_jaxpr(fn)(*args)).count("dot_general")
  return cost["flops"], dots


def test_only_the_configured_heads_are_read():
  rng = np.random.default_rng(2)
  gamma = 3
  one = DustinTarget(budget=8, n_sink=1, n_window=1, target_heads=((1, 2),))
  costs = []
  for layers in (2, 6):   # a deeper model: same estimator cost
    cache = make_cache(rng, layers, [12])
    taps = {l: jnp.asarray(rng.normal(size=(B, gamma + 1, HQ, D)), jnp.float32)
            for l in range(layers)}   # even if every layer were tapped
    costs.append(_cost(lambda s, t, c: one.observe_target(s, t, c, gamma),
                       one.init(B, S), taps, cache))
  assert costs[0] == costs[1]
  # more heads -> more work, one srh_scores (one key read) per layer
  three = DustinTarget(budget=8, n_sink=1, n_window=1, target_heads=((1, 0), (1, 1), (3, 2)))
  assert three.target_tap_layers == (1, 3)
  flops3, dots3 = _cost(lambda s, t, c: three.observe_target(s, t, c, gamma),
                        three.init(B, S), taps, cache)
  assert flops3 > 2 * costs[0][0] and dots3 == 2 * costs[0][1]


def test_quest_metadata_covers_committed_rows_only():
  rng = np.random.default_rng(3)
  page, gamma = 4, 3
  q = Quest(budget=12, n_sink=1, n_window=4, layers=(1,), num_kv_heads=HKV, head_dim=D,
            dtype="float32", page=page)
  cache = make_cache(rng, 2, [13])
  garbage = cache.k[1].at[:, :, 13:].set(1e3)   # the block / stale rows
  cache = cache.with_layer(1, garbage, garbage)
  signals = q.init(B, S)
  observe = jax.jit(lambda s, t, c: q.observe_target(s, t, c, gamma))

  def check(signals, L):
    k = np.asarray(cache.k[1])[0]
    for p in range(S // page):
      rows = k[:, p * page:min((p + 1) * page, L)]
      mn, mx = np.asarray(signals["kmin"][0])[0, :, p], np.asarray(signals["kmax"][0])[0, :, p]
      if rows.shape[1] == 0:
        assert np.all(np.isinf(mn)) and np.all(np.isinf(mx))
      else:
        np.testing.assert_array_equal(mn, rows.min(axis=1))
        np.testing.assert_array_equal(mx, rows.max(axis=1))
    assert int(signals["upto"][0]) == L

  taps = {1: jnp.asarray(rng.normal(size=(B, gamma + 1, HQ, D)), jnp.float32)}
  signals = observe(signals, taps, cache)          # first call: full rebuild
  check(signals, 13)
  assert np.all(np.asarray(signals["score"])[0, 4:] == 0)   # pages without a committed row
  np.testing.assert_allclose(np.asarray(signals["score"]).sum(), HQ * (gamma + 1), rtol=1e-5)
  prev = 13
  for L in (15, 19, 20):                           # commits of 2, 4, 1 rows: incremental
    real = jnp.asarray(rng.normal(size=(B, HKV, L - prev, D)) * 0.1, jnp.float32)
    k = cache.k[1].at[:, :, prev:L].set(real)      # the accepted rows; the rest stays garbage
    prev = L
    cache = cache.with_layer(1, k, k).with_lengths(jnp.asarray([L]))
    signals = observe(signals, taps, cache)
    check(signals, L)
  # a query aligned with a key: its page gets the highest score
  k = cache.k[1].at[:, 0, 9].set(jnp.ones(D) * 2.0)
  cache = cache.with_layer(1, k, k)
  q0 = np.asarray(rng.normal(size=(B, gamma + 1, HQ, D)) * 0.01)
  q0[:, :, 0] = 5.0
  sc = sig.page_scores(jnp.asarray(q0, jnp.float32), *sig.rebuild_pages(cache.k[1], cache.lengths, page),
                       cache.lengths, page)
  assert int(jnp.argmax(sc[0])) == 9 // page


def test_attention_weights_are_context_renormalised_probabilities():
  rng = np.random.default_rng(4)
  t, L = 3, 10
  cache = make_cache(rng, 1, [L])
  q = jnp.asarray(rng.normal(size=(B, t, HQ, D)), jnp.float32)
  w = np.asarray(sig.attention_weights(q, cache.k[0], cache.lengths))
  # numpy oracle of the definition (test only)
  k = np.asarray(cache.k[0])[0]
  want = np.zeros(S)
  for h in range(HQ):
    for j in range(t):
      logits = k[h // 2, :L + j + 1] @ np.asarray(q)[0, j, h] / np.sqrt(D)
      p = np.exp(logits - logits.max())
      p /= p.sum()
      want[:L] += p[:L] / p[:L].sum()
  np.testing.assert_allclose(w[0], want / (HQ * t), rtol=1e-5, atol=1e-7)
  assert w[0, L:].sum() == 0 and w[0].sum() == pytest.approx(1.0, rel=1e-5)


def test_arr_and_oracle_optimality():
  rng = np.random.default_rng(5)
  w = rng.random((2, 3, S)).astype(np.float32)
  lengths = jnp.asarray([20, 7])
  w[:, :, 20:] = 0
  w[1, :, 7:] = 0
  w = w / w.sum(axis=2, keepdims=True)
  w = jnp.asarray(w)
  arr, per_layer = arr_of_indices(w, None, lengths)
  assert np.all(np.asarray(arr) == 1) and per_layer.shape == (2, 3)
  full = jnp.asarray([list(range(20)), list(range(7)) + [-1] * 13])
  np.testing.assert_allclose(arr_of_indices(w, full, lengths)[0], 1.0, rtol=1e-5)
  o = Oracle(budget=5, num_layers=3)
  best = o.select({"w": w.sum(axis=1)}, KVCache(k=(jnp.zeros((2, 1, S, 1)),), v=(),
                                                lengths=lengths), 3)
  best_arr = np.asarray(arr_of_indices(w, best, lengths)[0])
  for _ in range(50):
    other = jnp.asarray(np.stack([rng.choice(20, 5, replace=False),
                                  rng.choice(7, 5, replace=False)]))
    assert np.all(best_arr >= np.asarray(arr_of_indices(w, other, lengths)[0]) - 1e-6)


def test_oracle_indices_and_arr_of_step_outside_a_step(tmp_path):
  from conftest import save_tiny_checkpoint
  from dustin_jax.decoding import Model
  from dustin_jax.prefill import prefill
  from dustin_jax.selection.arr import arr_of_step, oracle_indices
  from dustin_jax.weights import load_hf_checkpoint
  save_tiny_checkpoint(tmp_path, "llama", seed=3, num_hidden_layers=2)
  target = Model(*load_hf_checkpoint(str(tmp_path), dtype="float32"))
  rng = np.random.default_rng(6)
  prompts = [rng.integers(0, 97, size=n).tolist() for n in (17, 11)]
  cache = prefill(target, KVCache.init(target.cfg, 2, 32), prompts)
  block = jnp.asarray(rng.integers(0, 97, size=(2, 4)), jnp.int32)
  idx = oracle_indices(target, cache, block, 6)
  assert idx.shape == (2, 6) and np.all(np.asarray(idx) < np.asarray(cache.lengths)[:, None])
  best, per_layer = arr_of_step(target, cache, block, idx)
  assert per_layer.shape == (2, 2) and np.all(np.asarray(best) < 1)
  recent = jnp.asarray(np.asarray(cache.lengths)[:, None] - 6 + np.arange(6)[None], jnp.int32)
  assert np.all(np.asarray(best) >= np.asarray(arr_of_step(target, cache, block, recent)[0]))
  np.testing.assert_allclose(arr_of_step(target, cache, block, None)[0], 1.0)
