"""sparse_verify_packed (a verify layer's RoPE, cache writes and sparse
attention from the packed q/k/v): the reference vs the model's op-by-op
composition; the Pallas GPU kernel (interpret mode on CPU) vs the reference."""
import numpy as np
import pytest

import jax.numpy as jnp

from kernels.sparse_verify import ops
from kernels.sparse_verify.reference import (sparse_verify_packed_reference,
                                             sparse_verify_reference)
from kernel_cases import (ON_GPU, assert_compiled_close, check_caches, make_case,
                          packed, rel_err)


def random_indices(seed, lengths, K, fill=0.8):
  """int32[B, K]: distinct context rows < lengths[b] in random order, a share
  `fill` of them real, the rest -1, and one out-of-range entry (L + 3, a
  row the block writes) that must count as padding."""
  rng = np.random.default_rng(seed)
  idx = np.full((len(lengths), K), -1, np.int32)
  for b, l in enumerate(lengths):
    n = min(K - 1, l)
    chosen = rng.choice(l, size=n, replace=False)
    idx[b, :n] = np.where(rng.random(n) < fill, chosen, -1)
    idx[b, K - 1] = l + 3
    rng.shuffle(idx[b])
  return jnp.asarray(idx)


def composition(q, k_new, v_new, k_cache, v_cache, L, cos, sin, idx):
  """The model's verify attention op by op (full-width RoPE tables)."""
  from dustin_jax.cache import write_rows
  from dustin_jax.models.decoder import apply_rope
  c2 = jnp.concatenate([cos, cos], -1)
  s2 = jnp.concatenate([sin, sin], -1)
  kc = write_rows(k_cache, apply_rope(k_new, c2, s2), L)
  vc = write_rows(v_cache, v_new, L)
  return sparse_verify_reference(apply_rope(q, c2, s2), kc, vc, L, idx), kc, vc


@pytest.mark.parametrize("T,dtype", [(1, jnp.float32), (5, jnp.float32),
                                     (5, jnp.bfloat16)])
def test_reference_equals_composition(T, dtype):
  lengths = [3, 40, 57]
  args = make_case(0, 3, T, 8, 2, 64, 16, lengths, dtype)
  idx = random_indices(0, lengths, 12)
  out, kc, vc = sparse_verify_packed_reference(*packed(args)[:4], idx,
                                                 *args[6:])
  ref, kc_ref, vc_ref = composition(*args, idx)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(ref, np.float32))
  np.testing.assert_array_equal(np.asarray(kc, np.float32),
                                np.asarray(kc_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(vc, np.float32),
                                np.asarray(vc_ref, np.float32))


def test_errors():
  args = make_case(1, 2, 5, 8, 2, 64, 16, [10, 20])
  idx = random_indices(1, [10, 20], 8)
  with pytest.raises(ValueError, match="indices"):
    ops.sparse_verify_packed(*packed(args)[:4], idx[0], *args[6:], impl="gpu",
                             interpret=True)
  with pytest.raises(ValueError, match="cos, sin"):
    ops.sparse_verify_packed(*packed(args)[:4], idx, args[6][..., :4], args[7])
  with pytest.raises(ValueError, match="power of two"):
    ops.sparse_verify_packed(*packed(args)[:4], idx, *args[6:], impl="gpu",
                             interpret=True, block_w=24)
  with pytest.raises(ValueError, match=r"unknown tuning \['combine'\]"):
    ops.sparse_verify_packed(*packed(args)[:4], idx, *args[6:], impl="gpu",
                             interpret=True, combine="fused")


# (T, Hq, Hkv, D, lengths, K, dtype, tuning)
GPU_CASES = [
    (5, 8, 2, 16, [3, 40, 57], 12, jnp.float32, dict(block_w=16, splits=1)),
    (1, 4, 2, 32, [0, 9, 50], 20, jnp.float32, dict(block_w=16, splits=1)),
    # G = 7, T = 5 (35 rows -> M = 64), the list over three programs, one of
    # which the list does not reach, merged after
    (5, 14, 2, 16, [5, 33, 58], 40, jnp.float32, dict(block_w=16, splits=4)),
    (5, 14, 2, 16, [5, 33, 58], 40, jnp.bfloat16, dict(block_w=16, splits=2)),
    # each block's loads after the previous block's math
    (5, 8, 2, 16, [3, 40, 57], 40, jnp.float32,
     dict(block_w=16, splits=2, prefetch=False)),
    (2, 4, 1, 16, [3, 40, 57], 24, jnp.bfloat16,
     dict(block_w=16, splits=1, prefetch=False)),
    # the default tuning (block_w 64 > K: one partly filled block)
    (5, 8, 2, 16, [3, 40, 57], 30, jnp.float32, {}),
    # every block of a program gathered before its math
    (5, 14, 2, 16, [5, 33, 58], 40, jnp.float32, dict(block_w=16, splits=2, unroll=True)),
    (2, 4, 1, 16, [3, 40, 57], 24, jnp.bfloat16, dict(block_w=16, splits=1, unroll=True)),
]


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_interpret(case):
  T, Hq, Hkv, D, lengths, K, dtype, tuning = case
  args = make_case(2, 3, T, Hq, Hkv, 64, D, lengths, dtype)
  idx = random_indices(2, lengths, K)
  out, kc, vc = ops.sparse_verify_packed(*packed(args)[:4], idx, *args[6:],
                                         impl="gpu", interpret=True, **tuning)
  ref, kc_ref, vc_ref = sparse_verify_packed_reference(*packed(args)[:4], idx,
                                                       *args[6:])
  assert out.shape == args[0].shape and out.dtype == dtype
  assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else 2e-2)
  check_caches(kc, vc, kc_ref, vc_ref, args, exact_k=dtype == jnp.bfloat16)


def test_all_context_equals_full_attention():
  """Every context row listed: the kernel equals attention over the whole
  cache plus the block (the full verification)."""
  from kernels.decode_attention.reference import decode_attention_reference
  from kernels.common import rope, unpack_qkv
  lengths = [40, 61]
  args = make_case(3, 2, 3, 8, 2, 64, 16, lengths)
  idx = jnp.where(jnp.arange(64)[None] < jnp.asarray(lengths)[:, None],
                  jnp.arange(64)[None], -1).astype(jnp.int32)
  qkv, k_cache, v_cache, L, cos, sin = packed(args)
  out, kc, vc = ops.sparse_verify_packed(qkv, k_cache, v_cache, L, idx, cos,
                                         sin, impl="gpu", interpret=True,
                                         block_w=16, splits=3)
  q = rope(unpack_qkv(qkv)[0], cos, sin)
  assert rel_err(out, decode_attention_reference(q, kc, vc, L)) < 1e-5


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("Hq,Hkv,D", [(28, 4, 128), (32, 8, 128), (8, 1, 128)])
@pytest.mark.parametrize("tuning", [{}, dict(splits=1), dict(prefetch=False), dict(unroll=True)])
def test_gpu_kernel_compiled_target_shapes(Hq, Hkv, D, tuning):
  # the target layers' shapes (7B, 8B, 72B on 8 ways), T = 5, K = 512
  lengths = [2000, 300, 1500, 1024]
  args = make_case(4, 4, 5, Hq, Hkv, 2048, D, lengths, jnp.bfloat16)
  idx = random_indices(4, lengths, 512)
  got = ops.sparse_verify_packed(*packed(args)[:4], idx, *args[6:], **tuning)
  assert_compiled_close(got, sparse_verify_packed_reference(
      *packed(args)[:4], idx, *args[6:]))
