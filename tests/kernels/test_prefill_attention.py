"""prefill_attention: the blockwise reference vs a naive full-mask oracle;
cuDNN (GPU) and splash (TPU; also in interpret mode here) vs the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.prefill_attention import ops
from kernels.prefill_attention.reference import prefill_attention_reference
from kernel_cases import ON_GPU, rel_err

ON_TPU = jax.default_backend() == "tpu"


def make_case(seed, B, S, Hq, Hkv, D, lengths, dtype=jnp.float32):
  """q [B, S, Hq, D], k, v [B, S, Hkv, D]; padding rows of k and v are NaN:
  a kernel that lets a padded key into a valid row shows it."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, S, Hq, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32)
  lengths = jnp.asarray(lengths, jnp.int32)
  pad = jnp.arange(S)[None, :, None, None] >= lengths[:, None, None, None]
  k, v = jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.nan, v)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), lengths


def naive(q, k, v, lengths, scale=None):
  """Full [S, S] causal + length mask, KV heads repeated, f64 numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, S, Hq, D = q.shape
  G = Hq // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  scale = 1 / np.sqrt(D) if scale is None else scale
  out = np.zeros_like(q)
  for b in range(B):
    n = int(lengths[b])
    if n == 0:
      continue
    s = np.einsum("thd,shd->hts", q[b, :n], k[b, :n]) * scale
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[b, :n] = np.einsum("hts,shd->thd", p, v[b, :n])
  return out


CASES = [  # B, S, Hq, Hkv, D, lengths, block_q, block_k
    (3, 100, 4, 2, 16, [1, 100, 37], 32, 16),      # S not a multiple of the block
    (2, 64, 14, 2, 32, [64, 0], 16, 16),           # G = 7, an empty row
    (2, 70, 6, 6, 8, [5, 70], 64, 32),             # G = 1, one query block + a tail
    (4, 96, 8, 4, 16, [96, 1, 50, 95], 32, 32),    # G = 2
    (1, 33, 7, 1, 8, [33], 8, 8),                  # MQA, many small blocks
    (2, 100, 4, 2, 16, [100, 60], 16, 64),         # key blocks wider than query blocks
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive_oracle(case):
  B, S, Hq, Hkv, D, lengths, bq, bk = case
  q, k, v, L = make_case(sum(lengths), B, S, Hq, Hkv, D, lengths)
  out = prefill_attention_reference(q, k, v, L, block_q=bq, block_k=bk)
  assert out.shape == q.shape and out.dtype == q.dtype
  ref = naive(q, k, v, L)
  assert np.isfinite(np.asarray(out)).all(), "a padded (NaN) key leaked"
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
  # rows past lengths are zero
  pad = np.arange(S)[None, :] >= np.asarray(L)[:, None]
  assert not np.asarray(out)[pad].any()


def test_reference_default_blocks_scale_and_jit():
  q, k, v, L = make_case(7, 2, 300, 8, 2, 32, [300, 123])
  out = jax.jit(lambda *a: prefill_attention_reference(*a, scale=0.2))(q, k, v, L)
  np.testing.assert_allclose(out, naive(q, k, v, L, scale=0.2), rtol=2e-5, atol=2e-5)


def test_reference_bf16_inputs():
  q, k, v, L = make_case(3, 2, 80, 14, 2, 64, [80, 41], jnp.bfloat16)
  out = prefill_attention_reference(q, k, v, L, block_q=32, block_k=32)
  assert out.dtype == jnp.bfloat16
  valid = np.arange(80)[None, :] < np.asarray(L)[:, None]
  assert rel_err(np.asarray(out, np.float32)[valid], naive(q, k, v, L)[valid]) < 1e-2


def test_dispatch_and_errors():
  q, k, v, L = make_case(2, 1, 40, 4, 2, 16, [31])
  if not (ON_GPU or ON_TPU):  # auto is the reference here
    np.testing.assert_array_equal(ops.prefill_attention(q, k, v, L),
                                  prefill_attention_reference(q, k, v, L))
  with pytest.raises(ValueError, match="impl"):
    ops.prefill_attention(q, k, v, L, impl="cuda")
  with pytest.raises(ValueError):
    ops.prefill_attention(q, k[..., :8], v, L, impl="reference")
  with pytest.raises(ValueError, match="multiple"):
    ops.prefill_attention(q[:, :, :3], k, v, L, impl="reference")
  with pytest.raises(ValueError, match="lengths"):
    ops.prefill_attention(q, k, v, L[None], impl="reference")


@pytest.mark.skipif(ON_GPU or ON_TPU, reason="the interpreter check runs on the CPU machine")
def test_tpu_splash_in_interpret_mode():
  """The splash path's layout, segment ids and scaling, run by the Pallas
  TPU interpreter on this machine (small: the interpreter is slow)."""
  q, k, v, L = make_case(5, 2, 200, 4, 2, 128, [1, 150])
  out = ops.prefill_attention(q, k, v, L, impl="tpu", block=128, interpret=True)
  np.testing.assert_allclose(out, naive(q, k, v, L), rtol=1e-4, atol=1e-4)


GPU_CASES = [  # B, S, Hq, Hkv, D, lengths
    (2, 4096, 28, 4, 128, [4096, 1]),        # Qwen2.5-7B heads
    (3, 2048, 14, 2, 64, [0, 2048, 777]),    # Qwen2.5-0.5B heads, an empty row
    (2, 1000, 32, 8, 128, [999, 1000]),      # Llama-3-8B heads, S not a multiple of 128
    (1, 512, 8, 8, 64, [300]),               # MHA
]


@pytest.mark.skipif(not ON_GPU, reason="cuDNN flash attention needs an NVIDIA GPU")
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_cudnn_matches_reference(case):
  from kernels.prefill_attention.gpu import uses_cudnn
  B, S, Hq, Hkv, D, lengths = case
  q, k, v, L = make_case(11, B, S, Hq, Hkv, D, lengths, jnp.bfloat16)
  assert uses_cudnn(q, k, v)
  out = jax.jit(lambda *a: ops.prefill_attention(*a, impl="gpu"))(q, k, v, L)
  ref = prefill_attention_reference(q, k, v, L)
  valid = np.arange(S)[None, :] < np.asarray(L)[:, None]
  o32, r32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert not o32[~valid].any(), "padding rows must be zero"
  assert rel_err(o32[valid], r32[valid]) < 2e-2


@pytest.mark.skipif(not ON_GPU, reason="the cuDNN dispatch runs on an NVIDIA GPU")
def test_gpu_f32_runs_the_reference():
  from kernels.prefill_attention.gpu import uses_cudnn
  q, k, v, L = make_case(12, 2, 256, 8, 2, 64, [256, 100])
  assert not uses_cudnn(q, k, v)
  out = ops.prefill_attention(q, k, v, L, impl="gpu")
  np.testing.assert_allclose(out, prefill_attention_reference(q, k, v, L), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_TPU, reason="splash attention compiles for a TPU only")
@pytest.mark.parametrize("case", GPU_CASES[:2])
def test_tpu_splash_matches_reference(case):
  B, S, Hq, Hkv, D, lengths = case
  q, k, v, L = make_case(13, B, S, Hq, Hkv, D, lengths, jnp.bfloat16)
  out = jax.jit(lambda *a: ops.prefill_attention(*a, impl="tpu"))(q, k, v, L)
  ref = prefill_attention_reference(q, k, v, L)
  valid = np.arange(S)[None, :] < np.asarray(L)[:, None]
  assert rel_err(np.asarray(out, np.float32)[valid], np.asarray(ref, np.float32)[valid]) < 2e-2
