"""The sharded step on 8 simulated CPU devices equals the unsharded one."""

import jax
import pytest

from conftest import save_tiny_checkpoint
from dustin_jax import sharding, weights
from dustin_jax.config import ConfigError, ModelConfig
from dustin_jax.decoding import Model
from dustin_jax.vanilla import generate
from dustin_jax.speculative.engine import generate_speculative
from dustin_jax.speculative.step import SpecConfig
from dustin_jax.weights import load_hf_checkpoint

needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  t, d = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
  # 8 query heads, 2 KV heads: a model axis of 4 or 8 replicates the KV heads
  save_tiny_checkpoint(t, "qwen2", seed=21, num_attention_heads=8, num_key_value_heads=2,
                       hidden_size=64, intermediate_size=128, vocab_size=96)
  save_tiny_checkpoint(d, "qwen2", seed=22, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, hidden_size=64, intermediate_size=128, vocab_size=96)
  return (Model(*load_hf_checkpoint(str(t), dtype="float32")),
          Model(*load_hf_checkpoint(str(d), dtype="float32")))


def shard(model: Model, mesh) -> Model:
  return Model(*weights.place_model(model.cfg, model.graphdef, model.state, mesh))


@pytest.mark.parametrize("policy,draft_kv", [("full", "full"), ("dustin", "full"),
                                             ("dustin", "streaming")])
@pytest.mark.parametrize("data,model", [(1, 8), (2, 4), (8, 1)])
@needs_8_devices
def test_sharded_speculative_equals_unsharded(models, data, model, policy, draft_kv, rng):
  from dustin_jax.selection.policies import policy_from_config
  target, draft = models
  prompts = [rng.integers(0, 96, size=n).tolist() for n in (29, 4, 33, 6, 27, 11, 5, 30)]
  # a budget below the context: the dustin selection really drops rows
  fields = dict(policy=policy, budget=16, n_sink=2, n_window=6, m=4)
  pol = policy_from_config(fields, target.cfg, draft.cfg)
  # a streaming draft cache smaller than the prompts: its window kernel drops rows
  stream = dict(draft_kv=draft_kv, draft_sink=2, draft_window=8)
  ref, _ = generate_speculative(target, draft, prompts, max_new_tokens=10, max_len=64,
                                cfg=SpecConfig(gamma=3, policy=pol, **stream))
  mesh = sharding.make_mesh(data, model)
  t, d = shard(target, mesh), shard(draft, sharding.draft_mesh(mesh))
  qkv = t.state["layers"][0]["self_attn"]["qkv_proj"]["kernel"][...]
  assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  if model > 1:  # each device holds whole KV-head groups: its query heads, k and v
    r, hd = t.cfg.num_heads // t.cfg.num_kv_heads, t.cfg.head_dim
    assert qkv.sharding.shard_shape(qkv.shape)[1] % ((r + 2) * hd) == 0
    gate_up = t.state["layers"][0]["mlp"]["gate_up_proj"]["kernel"][...]
    assert gate_up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
  # the policy of the (KV-replicated) sharded models: same heads, same budget
  pol = policy_from_config(fields, t.cfg, d.cfg)
  ours, _ = generate_speculative(t, d, prompts, max_new_tokens=10, max_len=64,
                                 cfg=SpecConfig(gamma=3, policy=pol, mesh=mesh, **stream))
  assert ours == ref


@needs_8_devices
def test_the_draft_runs_whole_on_every_device(models, rng, monkeypatch):
  """sharding.draft_mesh: the draft's weights and cache are replicated over
  the model axis, and its layers add no collectives to the compiled step;
  split like the target, every layer of every draft pass adds some. No
  cache write (a scatter) crosses devices either way."""
  import re
  from dustin_jax.speculative import engine, step as step_mod
  from dustin_jax.speculative.step import bind_spec_step
  target, draft = models
  prompts = [rng.integers(0, 96, size=n).tolist() for n in (9, 14)]
  mesh = sharding.make_mesh(2, 4)
  cfg = SpecConfig(gamma=3, mesh=mesh)

  def collectives(place_draft_on):
    t, d = shard(target, mesh), shard(draft, place_draft_on)
    st = engine.init_state(t, d, prompts, max_new_tokens=4, max_len=32, cfg=cfg)
    hlo = bind_spec_step(t, d, cfg).lower(st).compile().as_text()
    ops = [line for line in hlo.splitlines() if re.search(
        r"= \S+ (?:all-reduce|all-gather|collective-permute|all-to-all)(?:-start)?\(", line)]
    # the cache writes run per device (decoder.attention): no scatter moves data
    assert not [op for op in ops if "scatter" in op], "a cache write crosses devices"
    return len(ops), d, st

  n_whole, d, st = collectives(sharding.draft_mesh(mesh))
  assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(d.state))
  heads_per_device = lambda c: c.k[0].sharding.shard_shape(c.k[0].shape)[1]
  assert heads_per_device(st.draft) == draft.cfg.num_kv_heads  # whole (batch over data)
  assert heads_per_device(st.target) == 1                       # 2 KV heads x2 over 4 devices
  monkeypatch.setattr(step_mod, "draft_mesh", lambda m: m)  # the draft split like the target
  monkeypatch.setattr(engine, "draft_mesh", lambda m: m)
  n_split, _, _ = collectives(mesh)
  assert n_split >= n_whole + 2 * draft.cfg.num_layers * cfg.gamma, (n_split, n_whole)


@needs_8_devices
def test_sharded_vanilla_equals_unsharded(models, rng):
  target, _ = models
  prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 9)]
  ref, _ = generate(target, prompts, max_new_tokens=6, max_len=32)
  mesh = sharding.make_mesh(2, 4)
  ours, _ = generate(shard(target, mesh), prompts, max_new_tokens=6, max_len=32, mesh=mesh)
  assert ours == ref


@needs_8_devices
def test_replicated_kv_heads_keep_the_function(models, rng):
  target, _ = models
  cfg, state = weights.replicate_kv_heads(target.cfg, target.state, 4)
  assert cfg.num_kv_heads == 8
  prompts = [rng.integers(0, 96, size=7).tolist()]
  a, _ = generate(target, prompts, max_new_tokens=5, max_len=16)
  b, _ = generate(Model(cfg, weights.abstract_model(cfg)[0], state), prompts, max_new_tokens=5, max_len=16)
  assert a == b


@needs_8_devices
def test_mesh_must_cover_devices():
  with pytest.raises(ConfigError, match="does not cover"):
    sharding.make_mesh(3, 2)


def test_memory_plan_72b_hand_computed():
  from configs import shapes
  t = ModelConfig.from_hf(dict(shapes.QWEN25_72B), dtype="bfloat16")
  d = ModelConfig.from_hf(dict(shapes.QWEN25_05B), dtype="bfloat16")
  gib = 2**30
  # Qwen2.5-72B on 4 devices, tensor-parallel: per layer q/o 2*8192*8192, k/v 2*8192*1024,
  # MLP 3*8192*29568 split 4 ways; biases 8192 + 2*1024 split; 2 norms of 8192 replicated
  layer = (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 29568 + 8192 + 2048) // 4 + 2 * 8192
  target_w = (80 * layer + 2 * 152064 * 8192 // 4 + 8192) * 2
  # Qwen2.5-0.5B (14 q heads, 2 KV heads, tied): whole on every device (draft_mesh)
  dlayer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864 + 896 + 256 + 2 * 896
  draft_w = (24 * dlayer + 151936 * 896 + 896) * 2
  plan4 = sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=4)
  assert plan4.weights == target_w + draft_w
  # the draft's head also as int8 rows and f32 scales, beside its tied embedding
  assert sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=4,
                              draft_int8_head=True).weights == (
      target_w + draft_w + 151936 * 896 + 4 * 151936)
  # 32k x 16: 2 (k, v) * 80 layers * 16 * (8 KV heads / 4) * 32768 * 128 * 2 bytes = 40 GiB
  assert plan4.target_cache == 40 * gib
  # the draft's cache is whole on each device: 2 * 24 layers * 16 * 2 KV heads * 32768 * 64 * 2
  assert plan4.draft_cache == 2 * 24 * 16 * 2 * 32768 * 64 * 2 == 6 * gib
  assert sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=2).draft_cache == 6 * gib
  plan8 = sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=8)
  assert plan8.target_cache == 20 * gib
  assert plan8.total < plan4.total < 141e9
  # the whole model on one H200 cannot fit: a clear refusal naming the fix
  plan1 = sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=1, capacity=141 * 10**9)
  with pytest.raises(ConfigError, match="more devices") as refused:
    sharding.check_fits(plan1)
  assert "--config.mem_fraction" in str(refused.value)  # the allocator's share, the other fix


def test_memory_plan_counts_the_prefill_activations():
  """The layer-major prefill's peak at 16 x 32k for the 7B + 0.5B shapes,
  counted by hand: residual in and out, q and attention output, k and v
  over every token, and one 8192-token tile through the MLP (bf16)."""
  from configs import shapes
  t = ModelConfig.from_hf(dict(shapes.PAIRS["qwen7b"][0]), dtype="bfloat16")
  d = ModelConfig.from_hf(dict(shapes.PAIRS["qwen7b"][1]), dtype="bfloat16")
  plan = sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=1,
                              capacity=139 * 2**30)
  tokens = 16 * 32768
  target = (tokens * (2 * 3584 + 2 * 28 * 128 + 2 * 4 * 128) + 3 * 8192 * 18944) * 2
  assert plan.prefill == target  # the target's is the larger
  assert plan.total == plan.weights + plan.target_cache + plan.draft_cache + plan.prefill
  assert plan.fits() and "prefill activations" in plan.table()
  # a prefill that does not fit is refused before anything is allocated
  small = sharding.memory_plan(t, d, batch=16, max_len=32768, data=1, model=1,
                               capacity=plan.total - 1)
  with pytest.raises(ConfigError, match="does not fit"):
    sharding.check_fits(small)


class _Device:
  """A jax device as `device_capacity` sees it."""

  def __init__(self, platform, stats, hardware_id=0):
    self.platform, self.id, self.local_hardware_id, self._stats = platform, 9, hardware_id, stats

  def memory_stats(self):
    return self._stats


def test_device_capacity_without_memory_stats_is_the_allocators_share(monkeypatch):
  """XLA's VMM allocator reports no memory stats: the capacity is then its
  fraction of the device's memory, which the CUDA driver reports."""
  asked = []
  monkeypatch.setattr(sharding, "cuda_device_memory", lambda i: asked.append(i) or 100 * 2**30)
  for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    monkeypatch.delenv(var, raising=False)
  device = [_Device("gpu", None, hardware_id=3)]
  monkeypatch.setattr(jax, "devices", lambda: device)
  assert sharding.device_capacity() == 75 * 2**30 and asked == [3]
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # --config.mem_fraction
  assert sharding.device_capacity() == 50 * 2**30
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")  # jax's newer name wins
  assert sharding.device_capacity() == 90 * 2**30
  # an allocator that reports its limit is taken at its word
  device[0] = _Device("gpu", {"bytes_limit": 123})
  assert sharding.device_capacity() == 123
  # no driver to ask, a TPU without stats, a CPU: unknown
  monkeypatch.setattr(sharding, "cuda_device_memory", lambda i: None)
  device[0] = _Device("gpu", None)
  assert sharding.device_capacity() is None
  device[0] = _Device("tpu", None)
  assert sharding.device_capacity() is None
  device[0] = _Device("cpu", {"bytes_limit": 123})
  assert sharding.device_capacity() is None


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_device_capacity_on_this_gpu():
  """The allocator's share of the GPU, within 2% of what its allocation
  budget comes to (75% of the device's memory by default)."""
  total = sharding.cuda_device_memory(jax.devices()[0].local_hardware_id)
  assert total and total > 2**30
  assert sharding.device_capacity() == pytest.approx(sharding.mem_fraction() * total, rel=0.02)


# random weights of a 72B layer and vocabulary: ~1 min on 2 cores
@pytest.mark.slow
@needs_8_devices
def test_cli_72b_shape_reduced_layers_runs_a_step_on_8_devices(tmp_path, capsys):
  """The 72B layer shapes, one layer each, on 8 simulated devices (1 x 8 mesh)."""
  from configs import qwen72b
  from scripts.decode import run
  c = qwen72b.get_config()
  c.target.num_layers = 1
  c.draft.num_layers = 1
  c.batch_size, c.prompt_len, c.max_len, c.max_new_tokens = 8, 32, 128, 4
  c.progress = False
  c.selection.policy = "full"
  r = run(c)
  assert r["mesh"] == {"data": 1, "model": 8}
  assert r["stats"]["steps"] >= 1 and all(len(s["tokens"]) == 4 for s in r["sequences"])
  assert "memory per device, 8 devices (data 1 x model 8)" in capsys.readouterr().out
