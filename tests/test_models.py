"""The decoder against transformers' PyTorch models, and KV-cache semantics."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import save_tiny_checkpoint
from dustin_jax.cache import KVCache
from dustin_jax.decoding import Model
from dustin_jax.weights import load_hf_checkpoint


def load(path, dtype="float32"):
  cfg, graphdef, state = load_hf_checkpoint(path, dtype=dtype)
  return Model(cfg, graphdef, state)


def run(model: Model, tokens, cache, **kw):
  """Logits [B, T, V] of `tokens` at the cache's positions; writes without commit."""
  from flax import nnx
  m = nnx.merge(model.graphdef, model.state)
  hidden, cache, taps = m(jnp.asarray(tokens, jnp.int32), cache, **kw)
  return np.asarray(m.logits(hidden)), cache, taps


def chunked_logits(model: Model, tokens, chunk):
  """Logits of every position, computed chunk by chunk through the cache."""
  b, n = tokens.shape
  cache = KVCache.init(model.cfg, b, max_len=n + 8)
  outs = []
  for s in range(0, n, chunk):
    part = tokens[:, s:s + chunk]
    logits, cache, _ = run(model, part, cache)
    cache = cache.commit(jnp.full((b,), part.shape[1]))
    outs.append(logits)
  return np.concatenate(outs, axis=1)


def hf_logits(hf_model, tokens):
  with torch.no_grad():
    return hf_model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_logits_match_transformers(fixture, folded, request, rng):
  """Also as the CLI decodes: the layers' norm weights folded into q/k/v and
  gate/up (the checkpoints' norms are not all ones)."""
  path, hf = request.getfixturevalue(fixture)
  model = load(path)
  if folded:
    model = model.with_folded_norms().with_folded_norms()  # folding twice folds once
    from flax import nnx
    layers = nnx.merge(model.graphdef, model.state).layers
    assert all(l.input_layernorm.weight is None and l.post_attention_layernorm.weight is None
               for l in layers)
  tokens = rng.integers(0, model.cfg.vocab_size, size=(2, 37))
  ours = chunked_logits(model, tokens, chunk=16)  # a prompt longer than one chunk
  ref = hf_logits(hf, tokens)
  err = np.max(np.abs(ours - ref))
  assert err < 1e-4, err


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_matches_transformers(rope, tmp_path, rng):
  model_type = "llama" if rope["rope_type"] == "llama3" else "qwen2"
  hf = save_tiny_checkpoint(tmp_path, model_type, seed=3, rope_scaling=dict(rope))
  model = load(str(tmp_path))
  assert model.cfg.rope.rope_type == rope["rope_type"]
  tokens = rng.integers(0, model.cfg.vocab_size, size=(1, 300))  # past the original context
  err = np.max(np.abs(chunked_logits(model, tokens, chunk=128) - hf_logits(hf, tokens)))
  assert err < 1e-4, err


def test_bf16_close_to_f32(tiny_qwen, rng):
  path, _ = tiny_qwen
  tokens = rng.integers(0, 97, size=(1, 20))
  f32 = chunked_logits(load(path, "float32"), tokens, chunk=8)
  for bf16_model in (load(path, "bfloat16"), load(path, "bfloat16").with_folded_norms()):
    bf16 = chunked_logits(bf16_model, tokens, chunk=8)
    assert np.max(np.abs(f32 - bf16)) < 0.1 * np.max(np.abs(f32))


def test_prefill_then_steps_equals_one_forward(tiny_llama, rng):
  model = load(tiny_llama[0])
  tokens = rng.integers(0, 97, size=(2, 24))
  full = chunked_logits(model, tokens, chunk=24)
  stepwise = chunked_logits(model, tokens, chunk=1)
  mixed = chunked_logits(model, tokens, chunk=7)
  np.testing.assert_allclose(stepwise, full, atol=2e-5)
  np.testing.assert_allclose(mixed, full, atol=2e-5)


def test_ragged_batch_equals_each_alone(tiny_qwen, rng):
  model = load(tiny_qwen[0])
  lens = [5, 17, 11]
  seqs = [rng.integers(0, 97, size=n) for n in lens]
  # batched: each sequence's prefix committed to its own length, then 3 new tokens each
  cache = KVCache.init(model.cfg, 3, max_len=32)
  prefix = np.zeros((3, max(lens)), np.int64)
  for i, s in enumerate(seqs):
    prefix[i, :len(s)] = s
  _, cache, _ = run(model, prefix, cache)
  cache = cache.commit(jnp.asarray(lens))
  new = rng.integers(0, 97, size=(3, 3))
  batched, _, _ = run(model, new, cache)
  for i, s in enumerate(seqs):
    alone = chunked_logits(model, np.concatenate([s, new[i]])[None], chunk=64)[0, -3:]
    np.testing.assert_allclose(batched[i], alone, atol=2e-5)


def test_rollback_is_free(tiny_llama, rng):
  model = load(tiny_llama[0])
  tokens = rng.integers(0, 97, size=(2, 10))
  cache = KVCache.init(model.cfg, 2, max_len=32)
  _, cache, _ = run(model, tokens, cache)
  cache = cache.commit(jnp.array([10, 10]))
  # write 5 speculative tokens, keep 2 of the first sequence and 0 of the second
  spec = rng.integers(0, 97, size=(2, 5))
  _, cache, _ = run(model, spec, cache)
  cache = cache.commit(jnp.array([2, 0]))
  nxt = rng.integers(0, 97, size=(2, 1))
  after_rollback, _, _ = run(model, nxt, cache)
  for i, keep in enumerate([2, 0]):
    clean = np.concatenate([tokens[i], spec[i, :keep], nxt[i]])[None]
    ref = chunked_logits(model, clean, chunk=64)[0, -1]
    np.testing.assert_allclose(after_rollback[i, -1], ref, atol=2e-5)


def test_sparse_indices_covering_context_equal_full(tiny_qwen, rng):
  model = load(tiny_qwen[0])
  tokens = rng.integers(0, 97, size=(2, 12))
  cache = KVCache.init(model.cfg, 2, max_len=32)
  _, cache, _ = run(model, tokens, cache)
  cache = cache.commit(jnp.array([12, 9]))
  block = rng.integers(0, 97, size=(2, 4))
  full, _, _ = run(model, block, cache)
  idx = np.full((2, 16), -1, np.int32)
  idx[0, :12] = np.arange(12)
  idx[1, :9] = np.arange(9)
  sparse, _, _ = run(model, block, cache, kv_indices=jnp.asarray(idx))
  np.testing.assert_allclose(sparse, full, atol=2e-5)
  # and a strict subset changes the result (the indices are really used)
  idx[0, 3:12] = -1
  subset, _, _ = run(model, block, cache, kv_indices=jnp.asarray(idx))
  assert np.max(np.abs(subset[0] - full[0])) > 1e-3


def test_taps_return_queries_of_requested_layers(tiny_llama, rng):
  model = load(tiny_llama[0])
  cache = KVCache.init(model.cfg, 1, max_len=16)
  _, _, taps = run(model, rng.integers(0, 97, size=(1, 3)), cache, tap_layers=(0, 2))
  assert sorted(taps) == [0, 2]
  assert taps[2].shape == (1, 3, model.cfg.num_heads, model.cfg.head_dim)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_is_the_f32_product_rounded_once(bias):
  """A bf16 projection returns bf16 (no f32 result for XLA to convert), with
  the sum accumulated in f32: the f32 product (+ bias) rounded to bf16."""
  import jax
  from flax import nnx
  from dustin_jax.models.decoder import Linear
  lin = Linear(256, 48, bias=bias, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if bias:
    lin.bias[...] = jax.random.normal(jax.random.key(2), (48,), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (16, 256), jnp.bfloat16)
  got = lin(x)
  assert got.dtype == jnp.bfloat16
  want = x.astype(jnp.float32) @ lin.kernel[...].astype(jnp.float32)
  if bias:
    want = want + lin.bias[...].astype(jnp.float32)
  # within a bf16 ulp of the f32 result (a GEMM may sum in another order);
  # summing in bf16 over K = 256 is off by ~200 of these
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2**-7, atol=1e-6)


def test_shared_layer_function_is_inlined(tiny_llama):
  """Every layer runs through one jitted layer function (one trace and
  lowering per shape); XLA inlines its calls, so the compiled forward holds
  no call left to dispatch and each layer's kernels stay in one program."""
  import jax
  from flax import nnx
  model = load(tiny_llama[0])

  def forward(state, cache, tokens):
    hidden, cache, _ = nnx.merge(model.graphdef, state)(tokens, cache)
    return hidden, cache

  cache = KVCache.init(model.cfg, 2, 32)
  lowered = jax.jit(forward).lower(model.state, cache, jnp.zeros((2, 3), jnp.int32))
  assert lowered.as_text().count("call @_block(") == model.cfg.num_layers  # one per layer
  assert " call(" not in lowered.compile().as_text()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_int8_head_rows_within_half_a_step_of_the_matrix(fixture, request, rng):
  """`Decoder.quantize_head`: each vocabulary row is int8 times one scale,
  within half a step of the matrix it replaces (its largest entry at 127),
  so the f32 logits stay within the rows' rounding; the embedding is kept
  and an untied head's matrix dropped; a second call changes nothing."""
  from flax import nnx
  model = load(request.getfixturevalue(fixture)[0])
  m = nnx.merge(model.graphdef, model.state)
  w = np.array(m.embed_tokens[...] if m.lm_head is None else m.lm_head.kernel[...].T)
  m.embed_tokens[...] = m.embed_tokens[...].at[5].set(0.0)  # an all-zero row: scale 1, no NaN
  if m.lm_head is None:
    w[5] = 0.0
  embed = np.asarray(m.embed_tokens[...])
  hidden = jnp.asarray(rng.standard_normal((3, 2, m.cfg.hidden_size)), jnp.float32)
  want = np.asarray(m.logits(hidden))
  m.quantize_head()
  q, scale = np.asarray(m.int8_head.weight[...]), np.asarray(m.int8_head.scale[...])
  assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
  assert np.all(np.abs(q).max(axis=1)[np.abs(w).max(axis=1) > 0] == 127)
  assert np.all(np.abs(q * scale[:, None] - w) <= scale[:, None] / 2 * (1 + 1e-5))
  got = np.asarray(m.logits(hidden))
  bound = np.abs(np.asarray(hidden)).sum(-1, keepdims=True) * scale / 2  # sum |h_d| |err_vd|
  assert np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= bound + 1e-5)
  assert np.abs(got - want).max() > 0  # the rows were rounded: the check above could fail
  assert m.lm_head is None and np.array_equal(np.asarray(m.embed_tokens[...]), embed)
  m.quantize_head()
  np.testing.assert_array_equal(np.asarray(m.logits(hidden)), got)


def test_int8_head_is_sharded_over_the_vocabulary():
  """The int8 rows and their scales split over the mesh's model axis (the
  vocabulary), as the embedding they come from."""
  from dustin_jax import sharding
  assert sharding.param_axes(("int8_head", "weight")) == ("vocab", "embed")
  assert sharding.param_axes(("int8_head", "scale")) == ("vocab",)
  assert sharding.param_axes(("int8_head", "weight")) == sharding.param_axes(("embed_tokens",))
