"""decode_attention: Pallas kernels (interpret mode here, real on GPU) vs the
jnp reference, and the reference vs a float64 numpy loop."""
import numpy as np
import pytest

import jax.numpy as jnp

from kernels.decode_attention import ops
from kernels.decode_attention.reference import decode_attention_reference
from kernel_cases import ON_GPU, random_qkv, rel_err



def make_case(seed, B, T, Hq, Hkv, S, D, lengths, dtype=jnp.float32):
  return random_qkv(seed, B, T, Hq, Hkv, S, D, lengths, dtype)


def numpy_oracle(q, k, v, lengths, scale=None):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, Hq, D = q.shape
  Hkv = k.shape[1]
  G = Hq // Hkv
  scale = 1 / np.sqrt(D) if scale is None else scale
  out = np.zeros_like(q)
  for b in range(B):
    for t in range(T):
      n = int(lengths[b]) + t + 1
      for h in range(Hq):
        s = k[b, h // G, :n] @ q[b, t, h] * scale
        p = np.exp(s - s.max())
        out[b, t, h] = (p / p.sum()) @ v[b, h // G, :n]
  return out


def test_reference_matches_numpy_loop():
  q, k, v, L = make_case(0, 2, 5, 8, 2, 40, 16, [7, 30])
  ref = decode_attention_reference(q, k, v, L, scale=0.3)
  np.testing.assert_allclose(ref, numpy_oracle(q, k, v, L, scale=0.3),
                             rtol=1e-5, atol=1e-5)


def test_reference_large_T_chunked_prefill():
  # Chunked prefill calls the reference with T = chunk size.
  q, k, v, L = make_case(1, 1, 48, 4, 2, 64, 16, [3])
  ref = decode_attention_reference(q, k, v, L)
  np.testing.assert_allclose(ref, numpy_oracle(q, k, v, L), rtol=1e-5,
                             atol=1e-5)


def test_auto_dispatch_and_errors():
  q, k, v, L = make_case(2, 1, 2, 4, 2, 32, 16, [9])
  out = ops.decode_attention(q, k, v, L)  # the kernel on a GPU, else the reference
  # the reference itself (1e-6) where it runs, the f32 kernel's rounding on a GPU
  np.testing.assert_allclose(out, decode_attention_reference(q, k, v, L),
                             rtol=1e-5 if ON_GPU else 1e-6, atol=1e-6 if ON_GPU else 0)
  with pytest.raises(ValueError):
    ops.decode_attention(q, k, v, L, impl="cuda")
  with pytest.raises(ValueError):
    ops.decode_attention(q, k[:, :, :, :8], v, L, impl="reference")


# (B, T, Hq, Hkv, S, D, lengths, dtype, tuning)
GPU_CASES = [
    # split-K with masked tails crossing chunk borders, odd lengths, G=4
    (2, 5, 8, 2, 300, 64, [100, 231], jnp.float32, dict(block_k=32, chunk=64)),
    # bf16, T=1, G=7, D=128, one chunk per (b, h): direct output path
    (1, 1, 7, 1, 200, 128, [117], jnp.bfloat16, dict(block_k=32, chunk=256)),
    # T=9, G=8, block crossing lengths inside a chunk
    (1, 9, 16, 2, 160, 64, [61], jnp.float32, dict(block_k=16, chunk=48)),
    # MHA (G=1), T=5, a chunk starting inside the verify block
    (2, 5, 2, 2, 128, 64, [59, 9], jnp.float32, dict(block_k=16, chunk=64)),
]


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_interpret(case):
  B, T, Hq, Hkv, S, D, lengths, dtype, tuning = case
  q, k, v, L = make_case(3, B, T, Hq, Hkv, S, D, lengths, dtype)
  ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                   L)
  out = ops.decode_attention(q, k, v, L, impl="gpu", interpret=True, **tuning)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_tpu_kernel_interpret():
  q, k, v, L = make_case(4, 2, 5, 8, 2, 256, 64, [100, 231])
  ref = decode_attention_reference(q, k, v, L)
  out = ops.decode_attention(q, k, v, L, impl="tpu", interpret=True,
                             block_k=32, chunk=64)
  assert rel_err(out, ref) < 1e-5


def test_tpu_kernel_interpret_bf16_T1():
  q, k, v, L = make_case(5, 1, 1, 7, 1, 128, 128, [77], jnp.bfloat16)
  ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                   L)
  out = ops.decode_attention(q, k, v, L, impl="tpu", interpret=True,
                             block_k=64)
  assert rel_err(out, ref) < 1e-2


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_compiled(case):
  B, T, Hq, Hkv, S, D, lengths, dtype, tuning = case
  q, k, v, L = make_case(6, B, T, Hq, Hkv, S, D, lengths, dtype)
  ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                   L)
  out = ops.decode_attention(q, k, v, L, impl="gpu", **tuning)
  assert rel_err(out, ref) < (1e-4 if dtype == jnp.float32 else 1e-2)


@gpu_only
@pytest.mark.parametrize("G,T,D", [(7, 5, 128), (4, 5, 128), (8, 9, 64),
                                   (1, 1, 128)])
def test_gpu_kernel_compiled_default_tuning(G, T, D):
  Hkv = 2
  q, k, v, L = make_case(7, 4, T, G * Hkv, Hkv, 5000, D,
                         [4995 - T, 1, 2345, 4000], jnp.bfloat16)
  ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                   L)
  out = ops.decode_attention(q, k, v, L)  # auto -> gpu, default tuning
  assert rel_err(out, ref) < 1e-2
