"""Offline SRH profiling: the search's ARR, the greedy search on planted
signals, m re-optimisation, and collection on a tiny real step agreeing
with the ARR that `profiling.runtime.evaluate_arr` measures."""

import jax.numpy as jnp
import numpy as np
import pytest

from dustin_jax.profiling import search
from dustin_jax.profiling.collect import _topn

S = 256


def write_item(path, w, draft, target, lengths):
  """An npz as `collect.collect_item` writes it (every row kept).
  draft[N, Hd, S]: the signal at step t; target[N, Ht, S]: recorded at t
  (the search uses it at t + 1)."""
  n = len(lengths)
  d = [_topn(draft[t], S, np.uint16) for t in range(n)]
  tg = [_topn(target[t], S, np.uint16) for t in range(n)]
  np.savez(path, lengths=np.asarray(lengths, np.int32), w=w.astype(np.float16),
           d_idx=np.stack([a for a, _ in d]), d_val=np.stack([b for _, b in d]),
           t_idx=np.stack([a for a, _ in tg]), t_val=np.stack([b for _, b in tg]),
           tau=np.float32(2.0), max_len=np.int32(S), draft_shape=np.asarray([3, 2]),
           target_shape=np.asarray([2, 2]), prefill_s=np.float32(0), decode_s=np.float32(0))
  return str(path)


def peaked(rng, length, support):
  w = np.zeros(S, np.float32)
  w[support] = rng.dirichlet(np.ones(len(support)))
  return w


def test_arr_of_config_on_a_hand_built_map():
  # one step, context 10: sink 1, window 2, free 2 rows picked by the signals
  w = np.zeros((1, 16), np.float32)
  w[0, [0, 3, 5, 8, 9]] = [0.1, 0.3, 0.2, 0.15, 0.25]
  draft = np.zeros((1, 16), np.float32)
  draft[0, 5] = 1.0
  draft[0, 12] = 9.0   # past the context: never selected
  target = np.zeros((1, 16), np.float32)
  target[0, 3] = 1.0
  target[0, 5] = 2.0   # already taken by the draft tier
  args = (jnp.asarray(draft), jnp.asarray(target), jnp.asarray([10], jnp.int32), jnp.asarray(w))
  kw = dict(budget=5, n_sink=1, n_window=2)
  # I = {0} + {8, 9} + draft {5} + target {3}: everything
  assert float(search.arr_of_config(*args, m=1, **kw)[0]) == pytest.approx(1.0)
  # m = 2: the draft tier takes 5 then the lowest zero-score row 1: loses 3
  assert float(search.arr_of_config(*args, m=2, **kw)[0]) == pytest.approx(0.7)
  # m = 0: the target tier takes 5 and 3
  assert float(search.arr_of_config(*args, m=0, **kw)[0]) == pytest.approx(1.0)


def synthetic(tmp_path, rng, *, plant_draft=None, plant_target=None, split=None, n=12):
  """Steps whose attention is predicted exactly by the planted heads; every
  other head is noise. split=(k1, k2): the attention is half on k1 rows only
  the draft head sees and half on k2 rows only the target head sees."""
  lengths = [200 + t for t in range(n)]
  w = np.zeros((n, S), np.float32)
  a = np.zeros((n, S), np.float32)
  b = np.zeros((n, S), np.float32)
  for t, ln in enumerate(lengths):
    rows = rng.permutation(np.arange(8, ln - 16))
    if split:
      k1, k2 = split
      a[t] = peaked(rng, ln, rows[:k1])
      b[t] = peaked(rng, ln, rows[k1:k1 + k2])
      w[t] = 0.5 * a[t] + 0.5 * b[t]
    else:
      w[t] = peaked(rng, ln, rows[:40])
      a[t] = b[t] = w[t]
  draft = rng.random((n, 6, S)).astype(np.float32) * 0.01
  target = rng.random((n, 4, S)).astype(np.float32) * 0.01
  if plant_draft is not None:
    draft[:, plant_draft] = a
  if plant_target is not None:
    target[:-1, plant_target] = b[1:]   # recorded at t, used at t + 1
  return search.load_calib([write_item(tmp_path / "item.npz", w, draft, target, lengths)])


KW = dict(budget=72, n_sink=4, n_window=4, heads_per_layer=1, head_budget=4, eps=1e-3)


def test_greedy_finds_a_planted_draft_head(tmp_path, rng):
  data = synthetic(tmp_path, rng, plant_draft=3)   # draft layer 1, head 1
  res = search.greedy_search(data, **KW)
  assert res.history[1]["added"] == dict(kind="draft", layer=1, heads=[[1, 1]])
  assert [1, 1] in res.draft_heads
  assert res.head_scores["draft"][0][:2] == [1, 1]
  assert res.arr == pytest.approx(1.0, abs=1e-3)   # 40 rows < free budget: all recovered
  assert res.baselines["oracle"] == pytest.approx(1.0, abs=1e-3)
  assert res.baselines["streaming"] < res.baselines["oracle"]


def test_greedy_finds_a_planted_target_head_through_the_one_step_shift(tmp_path, rng):
  data = synthetic(tmp_path, rng, plant_target=2)  # target layer 1, head 0
  res = search.greedy_search(data, **KW)
  assert res.history[1]["added"]["kind"] == "target"
  assert res.history[1]["added"]["heads"] == [[1, 0]]
  assert res.history[1]["m"] == 0
  # the first step has no history: its ARR is what sink + window + noise give
  assert 0.9 < res.arr < 1.0


def test_m_is_reoptimised_to_the_split_the_signals_predict(tmp_path, rng):
  data = synthetic(tmp_path, rng, plant_draft=3, plant_target=2, split=(16, 48))
  res = search.greedy_search(data, **KW)
  assert [1, 1] in res.draft_heads and [1, 0] in res.target_heads
  assert res.m == 16
  curve = dict(res.m_curve)
  assert curve[16] == max(curve.values())
  assert curve[16] > curve[0] + 0.05 and curve[16] > curve[64] + 0.05


def test_collected_search_arr_equals_the_step_measurement(tmp_path):
  """Collection on a tiny pair, then the search's ARR of a head set equals
  what evaluate_arr measures for the Dustin policy with those heads on the
  same (lossless) trajectory."""
  from dustin_jax.profiling import collect
  from dustin_jax.profiling.runtime import load_pair
  from dustin_jax.profiling.runtime import evaluate_arr
  from dustin_jax.selection.policies import make_policy
  from dustin_jax.speculative.step import SpecConfig
  pair = load_pair("tiny")
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, 259, size=60).tolist()
  item = collect.CalibItem("random", 0, prompt)
  max_len, gamma, new = 80, 3, 10
  paths = collect.collect(pair, [item], str(tmp_path), gamma=gamma, max_new=new,
                          max_len=max_len, top_n=max_len)
  data = search.load_calib(paths)
  dh, th = [[1, 0], [2, 3]], [[0, 1], [2, 2]]
  budget, n_sink, n_window, m = 24, 2, 6, 6
  ev = search.Evaluator(data, budget, n_sink, n_window)
  nd, nt = pair.draft.cfg.num_heads, pair.target.cfg.num_heads
  ours = ev(jnp.asarray(data.dense("draft", [l * nd + h for l, h in dh])),
            jnp.asarray(data.dense("target", [l * nt + h for l, h in th])), m)
  policy = make_policy("dustin", budget=budget, n_sink=n_sink, n_window=n_window, m=m,
                       draft_heads=dh, target_heads=th)
  _, _, res = evaluate_arr(pair.target, pair.draft, [prompt], max_new_tokens=new,
                           max_len=max_len, cfg=SpecConfig(gamma=gamma, policy=policy),
                           verify="full")
  assert res.n == data.n_steps
  assert ours == pytest.approx(res.mean, abs=2e-3)   # float16 storage of the signals


def test_prefill_cache_on_disk_round_trips(tmp_path):
  from dustin_jax.profiling.runtime import load_pair, prefill_base
  pair = load_pair("tiny")
  prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
  a = prefill_base(pair, prompts, 16, cache_dir=str(tmp_path))
  assert len(list(tmp_path.glob("*.npy"))) == 2
  b = prefill_base(pair, prompts, 24, cache_dir=str(tmp_path))   # any max_len reuses the rows
  assert len(list(tmp_path.glob("*.npy"))) == 2
  for x, y in ((a.target, b.target), (a.draft, b.draft)):
    np.testing.assert_array_equal(x.lengths, y.lengths)
    for kx, ky in zip(x.k + x.v, y.k + y.v):
      np.testing.assert_array_equal(np.asarray(kx)[:, :, :5], np.asarray(ky)[:, :, :5])
      assert ky.shape[2] == 24 and not np.asarray(ky)[:, :, 5:].any()


def test_window_grid_prefers_a_wider_window_when_attention_is_local(tmp_path, rng):
  n, lengths = 6, [200 + t for t in range(6)]
  w = np.zeros((n, S), np.float32)
  for t, ln in enumerate(lengths):
    w[t] = peaked(rng, ln, np.arange(ln - 40, ln))   # the last 40 rows
  noise = lambda h: rng.random((n, h, S)).astype(np.float32)
  data = search.load_calib([write_item(tmp_path / "i.npz", w, noise(6), noise(4), lengths)])
  res = search.greedy_search(data, budget=72, n_sink=4, n_window=8, heads_per_layer=1,
                             head_budget=2, windows=[16, 48])
  assert res.n_window == 48 and res.arr == pytest.approx(1.0, abs=1e-3)
  assert [x[0] for x in res.window_curve] == [8, 16, 48]


@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("llama", True)])
def test_gguf_loader_releases_each_host_tensor_after_its_last_use(tmp_path, arch, tied):
  """The GGUF loader drops each dequantised tensor once the last parameter
  that reads it is built (a tied embedding feeds two), and the parameters
  equal those of a build that keeps every tensor."""
  import jax
  from test_gguf_file import hf_tensors, write_tiny_gguf
  from dustin_jax.config import ModelConfig
  from dustin_jax.gguf_file import read_gguf
  from dustin_jax.weights import load_gguf_checkpoint, params_from_hf_tensors
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, arch, hf_tensors(arch, tied))
  hf_config, tensors = read_gguf(str(path), progress=False)
  cfg = ModelConfig.from_hf(hf_config, dtype="float32")
  released = []

  def get(name):
    assert name not in released, f"{name} read after its release"
    return tensors[name]

  _, kept = params_from_hf_tensors(cfg, get, set(tensors), release=released.append)
  assert sorted(released) == sorted(tensors)           # each one, once
  _, _, lean = load_gguf_checkpoint(str(path))
  for x, y in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(lean)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
