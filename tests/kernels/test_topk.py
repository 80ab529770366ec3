"""topk: the jnp reference vs lax.top_k (same set), the Pallas GPU kernel
(interpret mode on CPU) vs the reference (bit for bit), and the compiled
kernel at the step's shape on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

from kernels.topk import ops
from kernels.topk.gpu import topk_gpu
from kernels.topk.reference import topk_reference
from kernel_cases import ON_GPU


def score_rows(seed, S, k):
  """f32[13, S], one kind of row each: random normal; a small integer set
  (ties at the threshold); negatives only; +-0.0 among +-1; fewer than k
  finite (the rest -inf, scattered); a masked tail past a length < k; all
  -inf; constant; normal with a run of equal values at the top; NaNs of both
  signs among normal values; 1.0 and -1.0 plus 0..39 ulps (keys that differ
  in the lowest bits only, with ties: every radix pass matters); fewer than
  k normal values among the NaN of bits 0xFFFFFFFF (the smallest key, that
  of the kernel's padding lanes)."""
  rng = np.random.default_rng(seed)
  normal = lambda: rng.standard_normal(S).astype(np.float32)
  few = np.full(S, -np.inf, np.float32)
  few[rng.choice(S, k // 2, replace=False)] = normal()[:k // 2]
  tail = normal()
  tail[max(1, k - 3):] = -np.inf
  run = normal()
  run[S // 3:S // 3 + k] = 7.0  # with the 3 below, more than k equal maxima
  run[rng.choice(S, 3, replace=False)] = 7.0
  nans = normal()
  nans[rng.choice(S, 4, replace=False)] = [np.nan, -np.nan, np.nan, -np.nan]
  ulps = rng.integers(0, 40, S, dtype=np.int32)
  near_one = (np.float32(1.0).view(np.int32) + ulps).view(np.float32)
  lowest = np.full(S, -1, np.int32).view(np.float32)
  lowest[rng.choice(S, k // 2, replace=False)] = normal()[:k // 2]
  rows = [normal(), rng.integers(0, 4, S).astype(np.float32),
          -np.abs(normal()),
          rng.choice(np.array([-1.0, -0.0, 0.0, 1.0], np.float32), S),
          few, tail, np.full(S, -np.inf, np.float32),
          np.full(S, 1.5, np.float32), run, nans, near_one, -near_one,
          lowest]
  return jnp.asarray(np.stack(rows))


def assert_same_bits(got, want):
  """Exact equality of (values, indices), value bits included (-0.0, NaN)."""
  (gv, gi), (wv, wi) = got, want
  assert gi.dtype == jnp.int32 and gv.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(gi), np.asarray(wi))
  np.testing.assert_array_equal(np.asarray(gv).view(np.uint32),
                                np.asarray(wv).view(np.uint32))


def lax_topk_by_index(scores, k):
  """lax.top_k's selection, reordered by ascending index."""
  _, idx = lax.top_k(scores, k)
  idx = jnp.sort(idx, axis=1).astype(jnp.int32)
  return jnp.take_along_axis(scores, idx, axis=1), idx


# ---------------------------------------------------------------- reference
@pytest.mark.parametrize("S,k", [(1000, 37), (1000, 128), (2050, 304),
                                 (20, 1), (20, 20), (4096, 128)])
def test_reference_selects_lax_top_k_set(S, k):
  scores = score_rows(S + k, S, k)
  got = jax.jit(topk_reference, static_argnums=1)(scores, k)
  assert_same_bits(got, lax_topk_by_index(scores, k))
  assert np.all(np.diff(np.asarray(got[1]), axis=1) > 0)  # ascending index


def test_reference_orders_zeros_and_ties_like_lax_top_k():
  # +0.0 above -0.0; ties among equals go to the lower index; -inf filler
  # is the lowest-indexed -inf
  scores = jnp.array([[0.0, -0.0, 0.0, -0.0, -1.0, 1.0],
                      [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0],
                      [-jnp.inf, 1.0, -jnp.inf, -jnp.inf, 2.0, -jnp.inf]])
  vals, idx = topk_reference(scores, 4)
  np.testing.assert_array_equal(idx, [[0, 1, 2, 5], [0, 1, 3, 5],
                                      [0, 1, 2, 4]])
  np.testing.assert_array_equal(np.signbit(vals[1]), [True, False, False,
                                                      False])
  assert_same_bits((vals, idx), lax_topk_by_index(scores, 4))


# ---------------------------------------------------- the kernel, interpreted
# (S, k, tuning): one call per row, rows not a multiple of the block; two
# calls over chunks (the last chunk shorter than k at 2050 / 512, so padding
# lanes become candidates); 3-bit passes (32 bits do not split evenly: the
# last pass has 2); the default tuning (two calls at 2050, k 37); k = S, k = 1;
# calls over groups of candidates: 33 -> 17 -> 9 -> 5 -> 3 segments (the last
# group of each call holds one segment), and 5 -> 3 segments with the first
# call's padding lanes among the grouped candidates; segments held whole in
# one block (a row; chunks, groups and the last call).
KERNEL_CASES = [
    (1000, 37, dict(block=256, chunk=0)),
    (1000, 128, dict(block=128, chunk=256)),
    (2050, 304, dict(block=512, chunk=0)),
    (2050, 304, dict(block=256, chunk=512)),
    (1000, 128, dict(block=256, chunk=0, radix_bits=3)),
    (2050, 37, dict()),
    (20, 20, dict(block=16)),
    (20, 1, dict(block=16)),
    (4100, 37, dict(block=64, chunk=128, group=2)),
    (2050, 304, dict(block=256, chunk=512, group=2)),
    (1000, 128, dict(block=1024, chunk=0)),
    (2050, 304, dict(block=1024, chunk=512, group=2, radix_bits=4)),
]


@pytest.mark.parametrize("S,k,tuning", KERNEL_CASES)
def test_gpu_kernel_matches_reference_bits(S, k, tuning):
  scores = score_rows(S * 7 + k, S, k)
  got = topk_gpu(scores, k, interpret=True, **tuning)
  assert_same_bits(got, topk_reference(scores, k))


def test_default_tuning_splits_long_rows_only():
  from kernels.topk.gpu import default_tuning
  step = default_tuning(16, 34816, 304)
  assert step["chunk"] >= 304 and 34816 // step["chunk"] >= 2
  assert default_tuning(16, 2050, 304)["chunk"] == 0
  # groups from 8192 candidates a row: 16 chunks x k = 512, not x 304
  assert default_tuning(16, 34816, 512)["group"] > 1
  assert default_tuning(16, 34816, 304)["group"] == 0


@pytest.mark.parametrize("group, calls", [(0, 2), (4, 3), (2, 5)])
def test_groups_add_calls_while_each_leaves_two_programs_per_row(group, calls):
  # 16 chunks of 64 positions, then segments 16 -> 1 (group 0), 16 -> 4 -> 1
  # (group 4), 16 -> 8 -> 4 -> 2 -> 1 (group 2)
  x = jax.ShapeDtypeStruct((2, 1024), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda s: topk_gpu(s, 16, chunk=64, group=group))(x)
  assert str(jaxpr).count("pallas_call") == calls


def test_kernel_lowers_to_triton():
  # every primitive of the kernel has a Triton lowering rule (both calls)
  x = jax.ShapeDtypeStruct((16, 34816), jnp.float32)
  lowered = jax.jit(lambda s: topk_gpu(s, 304)).trace(x).lower(
      lowering_platforms=("cuda",))
  assert lowered.as_text().count("triton") >= 2


# ---------------------------------------------------------------- ops
def test_ops_dispatch_and_checks():
  scores = score_rows(3, 300, 40)
  want = topk_reference(scores, 40)
  assert_same_bits(ops.topk(scores, 40, impl="reference"), want)
  assert_same_bits(ops.topk(scores.astype(jnp.bfloat16), 40,
                            impl="reference"),
                   topk_reference(scores.astype(jnp.bfloat16)
                                  .astype(jnp.float32), 40))
  if not ON_GPU:
    assert_same_bits(ops.topk(scores, 40), want)  # auto: the reference
  for bad in (0, 301):
    with pytest.raises(ValueError, match="k="):
      ops.topk(scores, bad)
  with pytest.raises(ValueError, match=r"\[B, S\]"):
    ops.topk(scores[0], 4)
  with pytest.raises(ValueError, match="unknown tuning"):
    topk_gpu(scores, 4, interpret=True, block_k=64)
  with pytest.raises(ValueError, match="chunk"):
    topk_gpu(scores, 40, interpret=True, chunk=32)


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("k", [128, 304, 512])
# the default (segments held whole: chunks of 2048, candidate lists in
# blocks of up to 8192 keys); one call per row; segments re-read in blocks
# of 1024 keys
@pytest.mark.parametrize("tuning", [{}, dict(chunk=0), dict(block=1024, num_warps=4)])
def test_gpu_kernel_compiled_step_shape(k, tuning):
  # B 16 rows of S = 34816 (32k context), the tails past each row's length
  # masked -inf; rows of score_rows' kinds among them
  B, S = 16, 34816
  rng = np.random.default_rng(k)
  scores = rng.standard_normal((B, S)).astype(np.float32)
  lengths = rng.integers(k // 2, S, B)
  scores[np.arange(S)[None, :] >= lengths[:, None]] = -np.inf
  scores[:8] = np.asarray(score_rows(k, S, k))[:8]
  scores = jnp.asarray(scores)
  got = ops.topk(scores, k, **tuning)
  assert_same_bits(got, topk_reference(scores, k))
