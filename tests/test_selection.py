"""Selection: the tiered top-k (sink/window, draft tier, target tier), short
contexts, padding, ties, and one clear error per bad configuration."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dustin_jax.cache import KVCache
from dustin_jax.config import ConfigError, ModelConfig, RopeConfig
from dustin_jax.selection import srh as srhlib
from dustin_jax.selection.policies import (Dustin, DustinDraft, DustinTarget, Oracle, Quest,
                                           Streaming, make_policy, policy_from_config)
from dustin_jax.selection.select import tiered_select

S = 64


def cfg_of(layers=4, heads=4, kv=2):
  return ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=16 * heads,
                     intermediate_size=32, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     head_dim=16, rope=RopeConfig(theta=1e4), dtype="float32")


def cache_of(lengths, max_len=S):
  """A cache whose keys are never read: select needs lengths and max_len."""
  b = len(lengths)
  return KVCache(k=(jnp.zeros((b, 1, max_len, 1)),), v=(), lengths=jnp.asarray(lengths, jnp.int32))


def valid(row):
  row = np.asarray(row)
  return row[row >= 0]


def select_with(policy, draft=None, target=None, lengths=(S,), max_len=S):
  b = len(lengths)
  sig = policy.init(b, max_len)
  if draft is not None:
    sig["draft"] = jnp.asarray(draft, jnp.float32).reshape(b, max_len)
  if target is not None:
    sig["target"] = jnp.asarray(target, jnp.float32).reshape(b, max_len)
  return np.asarray(jax.jit(policy.select, static_argnums=2)(sig, cache_of(lengths, max_len), 3))


def hybrid(**kw):
  base = dict(budget=16, n_sink=2, n_window=4, m=4, draft_heads=((0, 0),), target_heads=((1, 1),))
  base.update(kw)
  return Dustin(**base)


def test_sink_window_draft_tier_then_target_tier():
  rng = np.random.default_rng(0)
  draft = rng.random(S)
  target = rng.random(S)
  draft[[20, 30, 31, 40, 41]] = [9, 8, 7, 6, 5]      # top-4 draft rows (41 is fifth)
  target[[41, 10, 11]] = 50                         # the best target rows
  target[[20, 30]] = 100                            # already drafted: not counted twice
  L = 50
  idx = select_with(hybrid(), draft, target, lengths=(L,))[0]
  assert idx.shape == (16,)
  v = valid(idx)
  assert len(v) == 16 and len(set(v)) == 16 and np.all(np.diff(v) > 0)
  assert {0, 1} <= set(v) and set(range(L - 4, L)) <= set(v)          # sink + window
  assert {20, 30, 31, 40} <= set(v)                                     # draft tier, m = 4
  rest = [p for p in range(2, L - 4) if p not in (20, 30, 31, 40)]
  want = sorted(rest, key=lambda p: (-target[p], p))[:6]
  assert set(v) - {0, 1, 20, 30, 31, 40} - set(range(L - 4, L)) == set(want)
  assert {41, 10, 11} <= set(want)


def test_never_selects_block_stale_or_padding_rows():
  big = np.zeros((2, S))
  big[:, 40:] = 1e6   # stale rows of rejected drafts / the block / padding
  idx = select_with(hybrid(), big, big, lengths=(40, 25))
  for row, L in zip(idx, (40, 25)):
    v = valid(row)
    assert v.max() < L
    assert len(v) == 16 and len(set(v)) == 16


@pytest.mark.parametrize("L", [1, 2, 5, 6, 11, 16])
def test_short_context_selects_everything_committed(L):
  idx = select_with(hybrid(), np.ones(S), np.ones(S), lengths=(L,))[0]
  assert list(idx[:L]) == list(range(L))
  assert np.all(idx[L:] == -1)


def test_budget_at_least_context_is_full_verification_with_ragged_batch():
  idx = select_with(hybrid(budget=S, m=10), np.ones((3, S)), np.ones((3, S)),
                    lengths=(S, 17, 3))
  for row, L in zip(idx, (S, 17, 3)):
    assert list(valid(row)) == list(range(L)) and np.all(row[L:] == -1)


def test_ties_break_towards_lower_positions():
  # all-zero signals (e.g. the first step after prefill): lowest free rows
  idx = select_with(hybrid(), np.zeros(S), np.zeros(S), lengths=(40,))[0]
  assert list(valid(idx)) == list(range(0, 12)) + list(range(36, 40))
  t = np.zeros(S)
  t[[30, 20, 25]] = 1.0
  idx = select_with(DustinTarget(budget=5, n_sink=1, n_window=2, target_heads=((0, 0),)),
                    target=t, lengths=(40,))[0]
  assert list(idx) == [0, 20, 25, 38, 39]


def test_pooling_pulls_in_neighbours():
  t = np.zeros(S)
  t[30] = 1.0
  p = DustinTarget(budget=6, n_sink=1, n_window=2, target_heads=((0, 0),), pool=3)
  assert list(select_with(p, target=t, lengths=(50,))[0]) == [0, 29, 30, 31, 48, 49]


def test_draft_only_and_streaming():
  d = np.zeros(S)
  d[[9, 19]] = 1.0
  p = DustinDraft(budget=6, n_sink=1, n_window=2, draft_heads=((0, 0),))
  assert p.draft_tier == 3 and p.target_tap_layers == ()
  assert list(select_with(p, draft=d, lengths=(50,))[0]) == [0, 1, 9, 19, 48, 49]
  s = Streaming(budget=6, n_sink=2)
  assert list(select_with(s, lengths=(50,))[0]) == [0, 1, 46, 47, 48, 49]
  assert list(select_with(s, lengths=(3,))[0]) == [0, 1, 2, -1, -1, -1]


def test_quest_selects_whole_pages_by_score():
  q = Quest(budget=2 + 2 + 8, n_sink=2, n_window=2, layers=(0,), num_kv_heads=1, head_dim=4,
            page=4)
  sig = q.init(1, S)
  score = np.zeros(S // 4)
  score[5] = 2.0   # rows 20..23
  score[2] = 1.0   # rows 8..11
  sig["score"] = jnp.asarray(score[None], jnp.float32)
  idx = np.asarray(q.select(sig, cache_of([40]), 3))[0]
  assert list(idx) == [0, 1, 8, 9, 10, 11, 20, 21, 22, 23, 38, 39]


def test_oracle_needs_the_full_verify_hook():
  o = Oracle(budget=4, num_layers=2)
  c = cache_of([10])
  with pytest.raises(ValueError, match="full-cache target pass"):
    o.select(o.init(1, S), c, 3)
  w = np.zeros((1, S))
  w[0, [3, 7, 8, 12]] = [0.5, 0.2, 0.2, 0.9]   # 12 is not committed
  idx = o.select({"w": jnp.asarray(w, jnp.float32)}, c, 3)
  assert list(np.asarray(idx)[0]) == [0, 3, 7, 8]  # then ties (zeros): the lowest row


def test_tiered_select_rejects_wrong_tier_sizes():
  with pytest.raises(ValueError, match="do not fill"):
    tiered_select(jnp.asarray([10]), S, 8, 2, 2, [(jnp.zeros((1, S)), 3)])


# -------------------------------------------------------------- bad configs
T, D = cfg_of(layers=4, heads=4), cfg_of(layers=2, heads=2, kv=1)


@pytest.mark.parametrize("kw,msg", [
    (dict(budget=5, n_sink=2, n_window=4), r"budget=5 is smaller than n_sink \+ n_window"),
    (dict(budget=16, n_sink=2, n_window=4, m=11), r"m=11 must lie in \[0, budget - n_sink - n_window = 10\]"),
    (dict(m=-1), r"m=-1 must lie"),
    (dict(reduce="mean"), "reduce must be one of"),
    (dict(pool=2), "pool must be an odd int"),
    (dict(draft_heads=()), "the draft tier .* needs draft_heads"),
    (dict(target_heads=()), "the target tier .* needs target_heads"),
    (dict(target_heads=[[1, 1], [1, 1]]), "duplicate"),
    (dict(target_heads=[[1]]), "not a \\[layer, head\\] pair"),
])
def test_bad_dustin_configs(kw, msg):
  with pytest.raises(ConfigError, match=msg):
    hybrid(**kw)


def test_bad_make_policy_inputs():
  good = dict(budget=16, n_sink=2, n_window=4, m=4, draft_heads=[[0, 1]], target_heads=[[3, 3]])
  p = make_policy("dustin", target_cfg=T, draft_cfg=D, **good)
  assert p.draft_heads == ((0, 1),) and p.target_tap_layers == (3,) and hash(p)
  with pytest.raises(ConfigError, match=r"unknown policy 'dustn'; choose one of"):
    make_policy("dustn", **good)
  with pytest.raises(ConfigError, match=r"target_heads: \(layer 4, head 0\) is out of range .* 4 layers x 4"):
    make_policy("dustin", target_cfg=T, draft_cfg=D, **{**good, "target_heads": [[4, 0]]})
  with pytest.raises(ConfigError, match=r"draft_heads: \(layer 0, head 2\) is out of range"):
    make_policy("dustin", target_cfg=T, draft_cfg=D, **{**good, "draft_heads": [[0, 2]]})
  with pytest.raises(ConfigError, match=r"policy 'dustin_target' has no field\(s\) \['draft_heads', 'm'\]"):
    make_policy("dustin_target", **good)
  with pytest.raises(ConfigError, match="layers .* out of range"):
    make_policy("quest", target_cfg=T, budget=16, n_sink=2, n_window=4, layers=[5])
  with pytest.raises(ConfigError, match="needs target_cfg"):
    make_policy("quest", budget=16)
  with pytest.raises(ConfigError, match="n_sink=9 must lie in"):
    make_policy("streaming", budget=8, n_sink=9)
  q = make_policy("quest", target_cfg=T, budget=16, n_sink=2, n_window=4)
  assert q.layers == (0, 1, 2, 3) and q.num_kv_heads == 2 and q.head_dim == 16
  assert make_policy("oracle", target_cfg=T, budget=8).full_verify_tap_layers == (0, 1, 2, 3)


def test_policy_from_config_and_defaults(tmp_path):
  import ml_collections
  c = ml_collections.ConfigDict(dict(policy="dustin", budget=32, n_sink=4, n_window=8, m=8,
                                     srh_file=""))
  p = policy_from_config(c, T, D)
  assert isinstance(p, Dustin) and (p.budget, p.n_sink, p.n_window, p.m) == (32, 4, 8, 8)
  assert p.target_heads == srhlib.default_heads(T) == ((2, 0), (2, 2), (3, 0), (3, 2))
  assert p.draft_heads == ((1, 0), (1, 1))
  for name, cls in (("dustin_target", DustinTarget), ("dustin_draft", DustinDraft),
                    ("streaming", Streaming), ("quest", Quest), ("oracle", Oracle)):
    assert isinstance(policy_from_config({**c.to_dict(), "policy": name}, T, D), cls)
  assert policy_from_config({"policy": "full"}, T, None).name == "full"
  with pytest.raises(ConfigError, match="unknown policy"):
    policy_from_config({"policy": "snapkv"}, T, D)
  with pytest.raises(ConfigError, match="needs a draft model"):
    policy_from_config(c, T, None)
  with pytest.raises(ConfigError, match="budget=8 is smaller"):
    policy_from_config({**c.to_dict(), "budget": 8}, T, D)
  # an SRH file gives the heads; None fields take the file's numbers
  path = tmp_path / "srh.json"
  srhlib.save_srh(srhlib.SRHConfig(target="t", draft="d", draft_heads=((0, 1),),
                                   target_heads=((3, 3), (1, 2)), m=5, n_sink=3, n_window=6,
                                   budget=40, arr=0.9, extra={"reduce": "max"}), str(path))
  p = policy_from_config({"policy": "dustin", "srh_file": str(path), "budget": None, "m": None},
                         T, D)
  assert (p.budget, p.n_sink, p.n_window, p.m, p.reduce) == (40, 3, 6, 5, "max")
  assert p.target_heads == ((1, 2), (3, 3))
  p = policy_from_config({"policy": "dustin", "srh_file": str(path), "budget": 64}, T, D)
  assert p.budget == 64 and p.m == 5


def test_srh_file_round_trip_and_errors(tmp_path):
  s = srhlib.default_srh(T, D, budget=64, n_sink=4, n_window=8)
  assert s.m == 26 and s.arr is None
  path = str(tmp_path / "a.json")
  srhlib.save_srh(s, path)
  back = srhlib.load_srh(path, T, D)
  assert back == s and json.load(open(path))["target_heads"][0] == [2, 0]

  def write(obj):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(p)

  good = s.to_json()
  with pytest.raises(ConfigError, match="does not exist"):
    srhlib.load_srh(str(tmp_path / "nope.json"))
  with pytest.raises(ConfigError, match="not valid JSON"):
    srhlib.load_srh(write("{"))
  with pytest.raises(ConfigError, match=r"missing key\(s\) \['m'\]"):
    srhlib.load_srh(write({k: v for k, v in good.items() if k != "m"}))
  with pytest.raises(ConfigError, match="not a \\[layer, head\\] pair"):
    srhlib.load_srh(write({**good, "draft_heads": [[0, -1]]}))
  with pytest.raises(ConfigError, match="arr must be a number"):
    srhlib.load_srh(write({**good, "arr": 2}))
  with pytest.raises(ConfigError, match="m=99 must lie"):
    srhlib.load_srh(write({**good, "m": 99}))
  with pytest.raises(ConfigError, match=r"bad.json.*\(layer 9, head 0\) is out of range"):
    srhlib.load_srh(write({**good, "target_heads": [[9, 0]]}), T, D)
  assert srhlib.default_layers(1) == (0,) and srhlib.default_layers(24) == (12, 18)
