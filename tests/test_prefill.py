"""The layer-major prefill (models/prefill.py) equals the oracle: the
prompts run through the step's decoder in chunks, each attending over the
whole cache with a mask (KV rows, lengths, and the logits of the next
decode step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dustin_jax.prefill import prefill
from dustin_jax.cache import KVCache
from dustin_jax.decoding import InputError, Model
from dustin_jax.models import prefill as layer_major
from dustin_jax.weights import load_hf_checkpoint


def load(path, dtype):
  return Model(*load_hf_checkpoint(path, dtype=dtype))


def chunked_prefill(model: Model, cache: KVCache, prompts, chunk: int = 16) -> KVCache:
  """The oracle: `prompt[:-1]` of each prompt through the decoder `chunk`
  tokens at a time, each chunk committed before the next."""
  m = nnx.merge(model.graphdef, model.state)
  bodies = [list(p)[:-1] for p in prompts]
  for start in range(0, max(len(p) for p in bodies), chunk):
    parts = [p[start:start + chunk] for p in bodies]
    tok = np.zeros((len(parts), chunk), np.int32)
    for i, part in enumerate(parts):
      tok[i, :len(part)] = part
    _, cache, _ = m(jnp.asarray(tok), cache)
    cache = cache.commit(jnp.asarray([len(part) for part in parts], jnp.int32))
  return cache


def next_logits(model: Model, cache: KVCache, prompts):
  """f32 logits of one decode step on the pending (last) prompt tokens."""
  m = nnx.merge(model.graphdef, model.state)
  pending = jnp.asarray([p[-1] for p in prompts], jnp.int32)[:, None]
  hidden, _, _ = m(pending, cache)
  return np.asarray(m.logits(hidden[:, 0]))


def both(model, prompts, max_len, **kw):
  b = len(prompts)
  old = chunked_prefill(model, KVCache.init(model.cfg, b, max_len), prompts)
  new = prefill(model, KVCache.init(model.cfg, b, max_len), prompts, **kw)
  return old, new


def assert_same(model, prompts, old, new, atol, logit_atol):
  n = np.array([len(p) - 1 for p in prompts])
  np.testing.assert_array_equal(new.lengths, n)
  np.testing.assert_array_equal(old.lengths, n)
  for i in range(model.cfg.num_layers):
    for name in ("k", "v"):
      o = np.asarray(getattr(old, name)[i], np.float32)
      w = np.asarray(getattr(new, name)[i], np.float32)
      for b, m in enumerate(n):
        np.testing.assert_allclose(w[b, :, :m], o[b, :, :m], atol=atol, rtol=0,
                                   err_msg=f"layer {i} {name} row {b}")
        assert not w[b, :, m:].any(), "rows past lengths must stay as they were (empty)"
  np.testing.assert_allclose(next_logits(model, new, prompts), next_logits(model, old, prompts),
                             atol=logit_atol, rtol=0)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_equals_chunked_prefill_f32(fixture, request, rng):
  model = load(request.getfixturevalue(fixture)[0], "float32")
  # token_block 64 over 5 rows: tiles of 8 positions. Bodies: 8 = exactly one
  # tile, 5 = shorter than a tile, 0 = a prompt of one token (nothing to
  # write), 37 = several tiles and a part, 60 = the longest
  prompts = [rng.integers(0, 97, size=n + 1).tolist() for n in (8, 5, 0, 37, 60)]
  old, new = both(model, prompts, 96, token_block=64)
  assert new.max_len == 96
  assert_same(model, prompts, old, new, atol=2e-5, logit_atol=1e-4)


def test_equals_chunked_prefill_bf16(tiny_qwen, rng):
  model = load(tiny_qwen[0], "bfloat16")
  prompts = [rng.integers(0, 97, size=n + 1).tolist() for n in (33, 1, 0, 70)]
  old, new = both(model, prompts, 80, token_block=32)
  assert new.k[0].dtype == jnp.bfloat16
  # bf16 activations: the two orders of the same math round differently
  # (measured on CPU: KV rows within 1 ulp (4e-3 at |x| ~0.7), logits within
  # 3e-3); on GPU the new path's attention is cuDNN's, which also rounds the
  # softmax weights to bf16 before their product with V
  tol = 6e-2 if jax.default_backend() == "gpu" else 2e-2
  assert_same(model, prompts, old, new, atol=tol, logit_atol=tol)


def test_bucket_and_tiles_with_a_remainder(tiny_llama, rng):
  """A cache shorter than the bucket clamps the padded length (70 rows),
  so the per-token tiles (24 positions) end with a partial one (22), and
  the reference attention pads 70 rows to its block of 72."""
  model = load(tiny_llama[0], "float32")
  prompts = [rng.integers(0, 97, size=n + 1).tolist() for n in (69, 24, 3)]
  b = len(prompts)
  old = chunked_prefill(model, KVCache.init(model.cfg, b, 70), prompts)
  tok = np.zeros((b, 70), np.int32)
  for i, p in enumerate(prompts):
    tok[i, :len(p) - 1] = p[:-1]
  lengths = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
  new = layer_major.prefill_cache(model.graphdef, model.state, KVCache.init(model.cfg, b, 70),
                                  jnp.asarray(tok), lengths, token_block=72)
  assert_same(model, prompts, old, new, atol=2e-5, logit_atol=1e-4)


def test_bucket_len():
  assert layer_major.bucket_len(1, 1 << 20) == 512
  assert layer_major.bucket_len(512, 1 << 20) == 512
  assert layer_major.bucket_len(513, 1 << 20) == 1024
  assert layer_major.bucket_len(3000, 1 << 20) == 3072
  assert layer_major.bucket_len(4095, 1 << 20) == 4096
  assert layer_major.bucket_len(4097, 1 << 20) == 5120
  assert layer_major.bucket_len(16385, 1 << 20) == 20480
  assert layer_major.bucket_len(3000, 2000) == 2000  # never past the cache
  sizes = {layer_major.bucket_len(n, 1 << 20) for n in range(1, 32769)}
  assert len(sizes) == 20  # few programs from 1 to 32k tokens
  assert all(n <= layer_major.bucket_len(n, 1 << 20) <= max(1.25 * n, n + 511)
             for n in range(1, 32769))


def test_nothing_to_write_and_input_errors(tiny_llama):
  model = load(tiny_llama[0], "float32")
  cache = prefill(model, KVCache.init(model.cfg, 2, 16), [[3], [5]])
  np.testing.assert_array_equal(cache.lengths, [0, 0])
  with pytest.raises(InputError, match="prompts for a batch"):
    prefill(model, KVCache.init(model.cfg, 2, 16), [[1, 2]])
  with pytest.raises(InputError, match="max_len 16"):
    prefill(model, KVCache.init(model.cfg, 1, 16), [list(range(20))])


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("data,model_ways", [(2, 4), (8, 1)])
def test_under_a_mesh_equals_unsharded(tiny_qwen, rng, data, model_ways):
  """Attention under shard_map (batch over "data", KV heads over "model";
  4 model ways on 2 KV heads replicate them), the rest partitioned by XLA."""
  from dustin_jax import sharding, weights
  model = load(tiny_qwen[0], "float32")
  prompts = [rng.integers(0, 97, size=n + 1).tolist() for n in (20, 3, 0, 31, 7, 12, 25, 9)]
  ref = prefill(model, KVCache.init(model.cfg, 8, 48), prompts, token_block=64)
  mesh = sharding.make_mesh(data, model_ways)
  sharded = Model(*weights.place_model(model.cfg, model.graphdef, model.state, mesh))
  cache = KVCache.init(sharded.cfg, 8, 48, mesh=mesh)
  out = prefill(sharded, cache, prompts, token_block=64, mesh=mesh)
  r = sharded.cfg.num_kv_heads // model.cfg.num_kv_heads  # KV heads replicated r times
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  for i in range(model.cfg.num_layers):
    np.testing.assert_allclose(np.asarray(out.k[i])[:, ::r], ref.k[i], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.v[i])[:, ::r], ref.v[i], atol=2e-5, rtol=0)
