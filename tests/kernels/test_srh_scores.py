"""srh_scores / select_topk: kernels vs the jnp reference, the reference vs a
float64 numpy loop, and the properties the selection relies on."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.srh_scores import ops
from kernels.srh_scores.reference import srh_scores_reference
from kernel_cases import ON_GPU, random_qkv



def make_case(seed, B, T, n, Hkv, S, D, lengths, dtype=jnp.float32):
  """n selected query heads [B, T, n, D] and a key cache, NaN past lengths + T."""
  q, k, _, lengths = random_qkv(seed, B, T, n, Hkv, S, D, lengths, dtype)
  return q, k, lengths


def numpy_oracle(q, k, lengths, kv_head, q_valid, reduce):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, n, D = q.shape
  S = k.shape[2]
  out = np.zeros((B, S))
  for b in range(B):
    probs = []
    for t in range(T):
      if q_valid is not None and not q_valid[b][t]:
        continue
      lim = int(lengths[b]) + t + 1
      for i in range(n):
        s = k[b, kv_head[i], :lim] @ q[b, t, i] / np.sqrt(D)
        p = np.zeros(S)
        p[:lim] = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        probs.append(p)
    if probs:
      out[b] = np.sum(probs, 0) if reduce == "sum" else np.max(probs, 0)
  return out


QV = [[True, False, True, True], [False, False, False, False]]


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_reference_matches_numpy_loop(reduce):
  q, k, L = make_case(0, 2, 4, 3, 4, 50, 16, [20, 41])
  kvh = (1, 3, 1)
  ref = srh_scores_reference(q, k, L, kvh, q_valid=jnp.array(QV),
                             reduce=reduce)
  np.testing.assert_allclose(ref, numpy_oracle(q, k, L, kvh, QV, reduce),
                             rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(ref[1]) == 0)  # no valid query: all zero


def test_reference_properties():
  q, k, L = make_case(1, 2, 5, 2, 2, 64, 16, [10, 50])
  sc = srh_scores_reference(q, k, L, (0, 1))
  # each (head, query) distributes probability 1
  np.testing.assert_allclose(np.asarray(sc).sum(1), 2 * 5, rtol=1e-5)
  # zero where no query may look (p >= lengths + T), and finite everywhere
  assert np.all(np.asarray(sc[0, 15:]) == 0) and np.all(np.asarray(sc[1, 55:]) == 0)
  assert np.isfinite(np.asarray(sc)).all()


def test_arg_checks():
  q, k, L = make_case(2, 1, 2, 2, 2, 32, 16, [9])
  with pytest.raises(ValueError):
    ops.srh_scores(q, k, L, (0,))
  with pytest.raises(ValueError):
    ops.srh_scores(q, k, L, (0, 2))
  with pytest.raises(ValueError):
    ops.srh_scores(q, k, L, (0, 1), reduce="mean")


def test_select_topk():
  sc = jax.random.uniform(jax.random.PRNGKey(3), (3, 100))
  vals, idx = ops.select_topk(sc, 7)
  assert idx.dtype == jnp.int32 and vals.shape == (3, 7)
  want = np.sort(np.asarray(sc), axis=1)[:, ::-1][:, :7]
  np.testing.assert_allclose(vals, want)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(sc),
                                                np.asarray(idx), 1), want)


def test_select_topk_two_stage_matches_lax_with_ties():
  sc = jax.random.uniform(jax.random.PRNGKey(4), (2, 3, 1000))
  sc = jnp.round(sc * 50) / 50  # many ties
  for k in (1, 7, 64):
    want = jax.lax.top_k(sc, k)
    got = ops.select_topk(sc, k, method="two_stage", segment=max(k, 96))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
  with pytest.raises(ValueError):
    ops.select_topk(sc, 8, method="two_stage", segment=4)


# (B, T, n, Hkv, S, D, lengths, kv_head, reduce, q_valid, dtype, tuning)
GPU_CASES = [
    (2, 5, 3, 4, 300, 64, [100, 231], (1, 1, 3), "sum",
     [[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], jnp.float32,
     dict(block_k=32, chunk=64, block_s=128)),
    (2, 4, 4, 4, 256, 128, [77, 200], (0, 1, 2, 3), "max", None, jnp.bfloat16,
     dict(block_k=16, chunk=48, block_s=64)),
    (1, 9, 2, 2, 128, 64, [61], (1, 1), "sum", None, jnp.float32,
     dict(block_k=16, chunk=128, block_s=256)),
]


def _qv(qv):
  return None if qv is None else jnp.asarray(qv, bool)


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_interpret(case):
  B, T, n, Hkv, S, D, lengths, kvh, reduce, qv, dtype, tuning = case
  q, k, L = make_case(4, B, T, n, Hkv, S, D, lengths, dtype)
  ref = srh_scores_reference(q.astype(jnp.float32), k.astype(jnp.float32), L,
                             kvh, q_valid=_qv(qv), reduce=reduce)
  out = ops.srh_scores(q, k, L, kvh, q_valid=_qv(qv), reduce=reduce,
                       impl="gpu", interpret=True, **tuning)
  assert out.shape == (B, S) and out.dtype == jnp.float32
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(out, ref, atol=tol * float(jnp.max(ref)),
                             rtol=tol)


def test_tpu_kernel_interpret():
  q, k, L = make_case(5, 2, 5, 3, 4, 256, 64, [100, 231])
  qv = jnp.asarray(GPU_CASES[0][9], bool)
  for reduce in ("sum", "max"):
    ref = srh_scores_reference(q, k, L, (1, 1, 3), q_valid=qv, reduce=reduce)
    out = ops.srh_scores(q, k, L, (1, 1, 3), q_valid=qv, reduce=reduce,
                         impl="tpu", interpret=True, block_k=128, block_s=128)
    np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_compiled(case):
  B, T, n, Hkv, S, D, lengths, kvh, reduce, qv, dtype, tuning = case
  q, k, L = make_case(6, B, T, n, Hkv, S, D, lengths, dtype)
  ref = srh_scores_reference(q.astype(jnp.float32), k.astype(jnp.float32), L,
                             kvh, q_valid=_qv(qv), reduce=reduce)
  out = ops.srh_scores(q, k, L, kvh, q_valid=_qv(qv), reduce=reduce,
                       impl="gpu", **tuning)
  tol = 1e-4 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(out, ref, atol=tol * float(jnp.max(ref)),
                             rtol=tol)


@gpu_only
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_gpu_kernel_compiled_default_tuning(reduce):
  q, k, L = make_case(7, 4, 5, 4, 4, 5000, 128, [4990, 3, 2345, 4000],
                      jnp.bfloat16)
  kvh = (0, 0, 2, 3)
  ref = srh_scores_reference(q.astype(jnp.float32), k.astype(jnp.float32), L,
                             kvh, reduce=reduce)
  out = ops.srh_scores(q, k, L, kvh, reduce=reduce)
  np.testing.assert_allclose(out, ref, atol=2e-2 * float(jnp.max(ref)),
                             rtol=2e-2)
  vals, idx = ops.select_topk(out, 64)
  assert idx.shape == (4, 64) and bool(jnp.all(idx < 5000))
