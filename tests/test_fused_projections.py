"""The fused projections (q/k/v in one matrix grouped per KV head, gate/up in
one matrix) compute what the separate Hugging Face projections do, and load,
shard, replicate and save by the Hugging Face names."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import save_tiny_checkpoint
from dustin_jax import sharding, weights
from dustin_jax.models.decoder import apply_rope, rope_tables


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
  """A GQA checkpoint (8 query heads on 2 KV heads; qwen2 with q/k/v biases),
  its separate HF tensors (numpy) and our loaded model."""
  path = tmp_path_factory.mktemp(request.param)
  hf = save_tiny_checkpoint(path, request.param, seed=7, num_attention_heads=8,
                            num_key_value_heads=2, hidden_size=64, intermediate_size=96)
  tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
  cfg, graphdef, state = weights.load_hf_checkpoint(str(path), dtype="float32")
  return str(path), tensors, cfg, graphdef, state


def _layer(graphdef, state, i):
  return nnx.merge(graphdef, state).layers[i]


def test_fused_qkv_equals_the_separate_projections(tiny, rng):
  _, t, cfg, graphdef, state = tiny
  x = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
  cos, sin = rope_tables(cfg, jnp.asarray(rng.integers(0, 300, size=(2, 5)), jnp.int32))
  for i in range(cfg.num_layers):
    q, k, v = _layer(graphdef, state, i).self_attn.qkv(x, cos, sin)
    def proj(name, heads):
      p = f"model.layers.{i}.self_attn.{name}."
      y = jnp.dot(x, jnp.asarray(t[p + "weight"]).T, precision="highest")
      if cfg.qkv_bias:
        y = y + jnp.asarray(t[p + "bias"])
      return y.reshape(2, 5, heads, cfg.head_dim)
    want_q = apply_rope(proj("q_proj", cfg.num_heads), cos, sin)
    want_k = apply_rope(proj("k_proj", cfg.num_kv_heads), cos, sin)
    want_v = proj("v_proj", cfg.num_kv_heads)
    assert q.shape == (2, 5, 8, cfg.head_dim) and k.shape == v.shape == (2, 5, 2, cfg.head_dim)
    np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(k), np.asarray(want_k), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(v), np.asarray(want_v), rtol=0, atol=1e-6)


def test_fused_gate_up_equals_the_separate_projections(tiny, rng):
  _, t, cfg, graphdef, state = tiny
  x = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
  for i in range(cfg.num_layers):
    got = _layer(graphdef, state, i).mlp(x)
    w = lambda name: jnp.asarray(t[f"model.layers.{i}.mlp.{name}.weight"]).T
    dot = lambda a, b: jnp.dot(a, b, precision="highest")
    want = dot(jax.nn.silu(dot(x, w("gate_proj"))) * dot(x, w("up_proj")), w("down_proj"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_fused_layouts_group_columns():
  """qkv_proj: per KV head g its query heads g*r .. g*r+r-1, then k_g, v_g;
  gate_up_proj: gate_j, up_j side by side."""
  from dustin_jax.models.decoder import gate_up_columns, qkv_columns
  hq, hkv, hd = 6, 2, 2  # r = 3; [q | k | v] columns: q 0..11, k 12..15, v 16..19
  assert qkv_columns(hq, hkv, hd).tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 16, 17,
                                               6, 7, 8, 9, 10, 11, 14, 15, 18, 19]
  assert gate_up_columns(3).tolist() == [0, 3, 1, 4, 2, 5]


def test_replicated_kv_heads_copy_k_and_v_per_group(tiny, rng):
  """replicate_kv_heads on the fused matrix: the same queries, each KV head
  repeated r times in place (query head h reads copy h // (Hq / Hkv'))."""
  _, _, cfg, graphdef, state = tiny
  cfg4, state4 = weights.replicate_kv_heads(cfg, state, 4)
  graphdef4 = weights.abstract_model(cfg4)[0]
  assert cfg4.num_kv_heads == 8
  x = jnp.asarray(rng.standard_normal((1, 3, cfg.hidden_size)), jnp.float32)
  cos, sin = rope_tables(cfg, jnp.arange(3, dtype=jnp.int32)[None])
  q, k, v = _layer(graphdef, state, 1).self_attn.qkv(x, cos, sin)
  q4, k4, v4 = _layer(graphdef4, state4, 1).self_attn.qkv(x, cos, sin)
  np.testing.assert_array_equal(np.asarray(q4), np.asarray(q))
  np.testing.assert_array_equal(np.asarray(k4), np.repeat(np.asarray(k), 4, axis=2))
  np.testing.assert_array_equal(np.asarray(v4), np.repeat(np.asarray(v), 4, axis=2))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_loading_onto_a_mesh_assembles_the_same_fused_matrices(tiny):
  """Under a mesh each device's slice of a fused matrix is assembled from
  the columns of q/k/v (gate/up) it needs: the same arrays as a whole load."""
  path, _, _, _, ref = tiny
  mesh = sharding.make_mesh(4, 2)
  _, _, state = weights.load_hf_checkpoint(path, dtype="float32", mesh=mesh)
  a = dict(sharding.leaves_with_paths(nnx.to_pure_dict(state)))
  b = dict(sharding.leaves_with_paths(nnx.to_pure_dict(ref)))
  assert a.keys() == b.keys()
  for p in a:
    np.testing.assert_array_equal(np.asarray(a[p]), np.asarray(b[p]), err_msg=str(p))
  qkv = a[("layers", 0, "self_attn", "qkv_proj", "kernel")]
  assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_orbax_checkpoint_of_separate_projections_loads(tiny, tmp_path):
  """An orbax checkpoint saved before the fusion (q/k/v and gate/up as
  separate projections) restores into the fused layout."""
  import orbax.checkpoint as ocp
  _, t, cfg, _, ref = tiny
  old = {}
  for name, arr in t.items():
    if name == "lm_head.weight" and cfg.tie_embeddings:
      continue
    parts = name.removeprefix("model.").split(".")
    if parts == ["embed_tokens", "weight"]:
      parts = ["embed_tokens"]
    elif parts[-1] == "weight" and arr.ndim == 2:
      parts[-1], arr = "kernel", arr.T
    node = old
    for p in parts[:-1]:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[parts[-1]] = arr
  out = os.path.abspath(tmp_path / "ckpt")
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(out, "params"), old)
  ckpt.wait_until_finished()
  with open(os.path.join(out, "dustin_config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f)
  cfg2, _, state = weights.load_checkpoint(out)
  assert cfg2 == cfg
  for x, y in zip(jax.tree_util.tree_leaves(nnx.to_pure_dict(state)),
                  jax.tree_util.tree_leaves(nnx.to_pure_dict(ref))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
