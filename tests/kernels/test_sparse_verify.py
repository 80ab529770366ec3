"""sparse_verify: Pallas kernels vs the jnp reference; the reference vs
decode_attention when every context row is selected."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.decode_attention.reference import decode_attention_reference
from kernels.sparse_verify import ops
from kernels.sparse_verify.reference import sparse_verify_reference
from kernel_cases import ON_GPU, random_qkv, rel_err


def make_case(seed, B, T, Hq, Hkv, S, D, lengths, K, dtype=jnp.float32,
              fill=0.8):
  """Random q/k/v with NaN garbage past lengths + T, and duplicate-free
  random indices < lengths (a share `fill` of them real, the rest -1)."""
  q, k, v, lengths = random_qkv(seed, B, T, Hq, Hkv, S, D, lengths)
  rng = np.random.default_rng(seed)
  idx = np.full((B, K), -1, np.int32)
  for b in range(B):
    n = min(K, int(lengths[b]))
    chosen = rng.choice(int(lengths[b]), size=n, replace=False)
    keep = rng.random(n) < fill
    idx[b, :n] = np.where(keep, chosen, -1)
    rng.shuffle(idx[b])
  return (q.astype(dtype), k.astype(dtype), v.astype(dtype), lengths,
          jnp.asarray(idx))


def all_context(lengths, K):
  ar = jnp.arange(K, dtype=jnp.int32)[None, :]
  return jnp.where(ar < lengths[:, None], ar, -1)


def f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def test_reference_all_context_equals_decode_attention():
  q, k, v, L, _ = make_case(0, 2, 5, 8, 2, 64, 16, [20, 50], 8)
  idx = all_context(L, 56)
  idx = jax.random.permutation(jax.random.PRNGKey(1), idx, axis=1,
                               independent=True)
  np.testing.assert_allclose(sparse_verify_reference(q, k, v, L, idx),
                             decode_attention_reference(q, k, v, L),
                             rtol=1e-5, atol=1e-5)


def test_reference_only_block_when_all_padding():
  # With every index -1, query t sees exactly the block rows L..L+t.
  q, k, v, L, _ = make_case(1, 1, 4, 2, 1, 32, 16, [10], 4)
  idx = jnp.full((1, 4), -1, jnp.int32)
  out = sparse_verify_reference(q, k, v, L, idx)
  # equivalent to full attention over a cache holding only the block rows
  kb, vb = k[:, :, 10:14], v[:, :, 10:14]
  np.testing.assert_allclose(
      out, decode_attention_reference(q, kb, vb, jnp.zeros((1,), jnp.int32)),
      rtol=1e-5, atol=1e-6)


def test_auto_dispatch_and_errors():
  q, k, v, L, idx = make_case(2, 1, 2, 4, 2, 32, 16, [9], 4)
  out = ops.sparse_verify(q, k, v, L, idx)  # the kernel on a GPU, else the reference
  # the reference itself (1e-6) where it runs, the f32 kernel's rounding on a GPU
  np.testing.assert_allclose(out, sparse_verify_reference(q, k, v, L, idx),
                             rtol=1e-5 if ON_GPU else 1e-6, atol=1e-6 if ON_GPU else 0)
  with pytest.raises(ValueError):
    ops.sparse_verify(q, k, v, L, idx[0], impl="reference")


# (B, T, Hq, Hkv, S, D, lengths, K, dtype, tuning)
GPU_CASES = [
    # G=4, T=5, split over 3 programs (XLA merge), odd lengths
    (2, 5, 8, 2, 300, 64, [100, 231], 64, jnp.float32,
     dict(block_k=16, splits=3)),
    # bf16, G=7, D=128, one program per (b, h) (direct output)
    (2, 5, 14, 2, 256, 128, [200, 77], 48, jnp.bfloat16,
     dict(block_k=32, splits=1)),
    # T=9, G=8; sequence 0 is shorter than the budget (mostly padding)
    (2, 9, 8, 1, 128, 64, [5, 100], 32, jnp.float32,
     dict(block_k=16, splits=2)),
    # T=1, G=1
    (1, 1, 2, 2, 96, 64, [61], 32, jnp.float32, dict(block_k=16, splits=1)),
]


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_interpret(case):
  B, T, Hq, Hkv, S, D, lengths, K, dtype, tuning = case
  q, k, v, L, idx = make_case(3, B, T, Hq, Hkv, S, D, lengths, K, dtype)
  ref = sparse_verify_reference(*f32(q, k, v), L, idx)
  out = ops.sparse_verify(q, k, v, L, idx, impl="gpu", interpret=True,
                          **tuning)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_gpu_kernel_interpret_all_context_equals_decode():
  q, k, v, L, _ = make_case(4, 2, 5, 8, 2, 160, 64, [100, 31], 8)
  idx = all_context(L, 112)
  idx = jax.random.permutation(jax.random.PRNGKey(5), idx, axis=1,
                               independent=True)
  out = ops.sparse_verify(q, k, v, L, idx, impl="gpu", interpret=True,
                          block_k=32, splits=2)
  assert rel_err(out, decode_attention_reference(q, k, v, L)) < 1e-5


def test_gpu_kernel_interpret_fused_combine():
  # The experimental in-kernel merge (last-arriving program, atomic counter).
  q, k, v, L, idx = make_case(10, 2, 5, 8, 2, 300, 64, [100, 231], 64)
  ref = sparse_verify_reference(q, k, v, L, idx)
  for splits in (2, 5):
    out = ops.sparse_verify(q, k, v, L, idx, impl="gpu", interpret=True,
                            block_k=16, splits=splits, combine="fused")
    assert rel_err(out, ref) < 1e-5
  with pytest.raises(ValueError):
    ops.sparse_verify(q, k, v, L, idx, impl="gpu", interpret=True,
                      combine="atomic")


def test_tpu_kernel_interpret():
  q, k, v, L, idx = make_case(6, 2, 5, 8, 2, 128, 64, [100, 20], 40)
  ref = sparse_verify_reference(q, k, v, L, idx)
  out = ops.sparse_verify(q, k, v, L, idx, impl="tpu", interpret=True,
                          block_k=16, splits=2)
  assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_compiled(case):
  B, T, Hq, Hkv, S, D, lengths, K, dtype, tuning = case
  q, k, v, L, idx = make_case(7, B, T, Hq, Hkv, S, D, lengths, K, dtype)
  ref = sparse_verify_reference(*f32(q, k, v), L, idx)
  out = ops.sparse_verify(q, k, v, L, idx, impl="gpu", **tuning)
  assert rel_err(out, ref) < (1e-4 if dtype == jnp.float32 else 1e-2)


@gpu_only
@pytest.mark.parametrize("G,T,K", [(7, 5, 512), (4, 5, 256), (8, 9, 1024),
                                   (1, 1, 2048)])
def test_gpu_kernel_compiled_default_tuning(G, T, K):
  Hkv = 2
  q, k, v, L, idx = make_case(8, 4, T, G * Hkv, Hkv, 5000, 128,
                              [4995 - T, 300, 2345, 4000], K, jnp.bfloat16)
  ref = sparse_verify_reference(*f32(q, k, v), L, idx)
  out = ops.sparse_verify(q, k, v, L, idx)
  assert rel_err(out, ref) < 1e-2


@gpu_only
def test_gpu_kernel_compiled_fused_combine():
  q, k, v, L, idx = make_case(11, 4, 5, 28, 4, 5000, 128,
                              [4990, 300, 2345, 4000], 512, jnp.bfloat16)
  ref = sparse_verify_reference(*f32(q, k, v), L, idx)
  for _ in range(3):  # a race would show as a moving error
    out = ops.sparse_verify(q, k, v, L, idx, splits=4, combine="fused")
    assert rel_err(out, ref) < 1e-2


@gpu_only
def test_gpu_all_context_equals_decode_attention():
  from kernels.decode_attention.ops import decode_attention
  q, k, v, L, _ = make_case(9, 2, 5, 28, 4, 2048, 128, [2000, 1500], 8,
                            jnp.bfloat16)
  idx = all_context(L, 2000)
  a = ops.sparse_verify(q, k, v, L, idx)
  b = decode_attention(q, k, v, L)
  assert rel_err(a, b) < 1e-2
