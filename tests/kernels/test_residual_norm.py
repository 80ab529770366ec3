"""residual_norm: the reference vs the model's RMSNorm of x + projection and
vs a float64 computation; the Pallas GPU kernel (interpret mode on CPU) vs
the reference; the compiled kernel at the models' shapes on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.residual_norm import ops
from kernels.residual_norm.reference import residual_norm_reference
from kernel_cases import ON_GPU, rel_err

EPS = 1e-6
# The model runs the reference inside a jit: XLA fuses it, and the fused
# rsqrt of XLA:CPU can differ by an f32 ulp from the op-by-op one, so the
# kernel is held to the jitted reference.
reference = jax.jit(residual_norm_reference, static_argnames="eps")


def make_inputs(seed, lead, d, S, dtype):
  """x [*lead, d] (dtype), parts f32[S, *lead, d] (None for S=None), weight
  [d] (dtype) in [0.5, 1.5): a missing weight shows in the float64 check."""
  kx, kp, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (*lead, d), jnp.float32).astype(dtype)
  parts = None if S is None else 0.5 * jax.random.normal(kp, (S, *lead, d),
                                                         jnp.float32)
  w = jax.random.uniform(kw, (d,), jnp.float32, 0.5, 1.5).astype(dtype)
  return x, parts, w


def ulp_distance(a, b):
  """Elementwise distance in units in the last place of two bf16 or f32
  arrays of the same dtype (consecutive floats are 1 apart)."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype
  bits = {2: (np.uint16, 0x8000), 4: (np.uint32, 0x80000000)}
  utype, sign = bits[a.dtype.itemsize]

  def key(v):
    u = v.view(utype).astype(np.int64)
    return np.where(u & sign, -(u & (sign - 1)), u)

  return np.abs(key(a) - key(b))


def assert_normed_close(got, want, max_ulps):
  """normed to the reference's: the kernel's row sums of squares run in
  another order than XLA's (and may differ in the last f32 bit), which
  after the rounding to bf16 moves an element by at most an ulp, and rarely;
  a missing or extra rounding would move many."""
  dist = ulp_distance(got, want)
  assert dist.max() <= max_ulps, dist.max()
  if got.dtype == jnp.bfloat16:
    assert (dist > 0).mean() <= 0.01, (dist > 0).mean()


def float64_result(x, parts, w):
  """The formula in float64, no intermediate rounding."""
  x64 = np.asarray(x, np.float64)
  if parts is not None:
    x64 = x64 + np.asarray(parts, np.float64).sum(0)
  rms = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS)
  return x64, np.asarray(w, np.float64) * x64 / rms


def check(got, x, parts, w, max_ulps):
  x_new, normed = got
  want_x, want_n = reference(x, parts, w, eps=EPS)
  assert x_new.shape == x.shape and normed.shape == x.shape
  assert x_new.dtype == x.dtype and normed.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(x_new), np.asarray(want_x))
  assert_normed_close(normed, want_n, max_ulps)
  # loosely against float64, so a formula wrong in both would fail
  x64, n64 = float64_result(x, parts, w)
  tol = 1e-2 if x.dtype == jnp.bfloat16 else 1e-5
  assert rel_err(x_new, x64) < tol
  assert rel_err(normed, n64) < 2 * tol


def test_reference_is_the_models_rmsnorm_of_x_plus_projection():
  from dustin_jax.models.decoder import RMSNorm
  from flax import nnx
  x, parts, w = make_inputs(0, (3, 5), 96, 4, jnp.bfloat16)
  norm = RMSNorm(96, EPS, jnp.bfloat16)
  norm.weight = nnx.Param(w)
  y = parts[0]  # the projection's output, its partials summed in order
  for s in range(1, parts.shape[0]):
    y = y + parts[s]
  x_new, normed = residual_norm_reference(x, parts, w, eps=EPS)
  np.testing.assert_array_equal(np.asarray(x_new),
                                np.asarray(x + y.astype(x.dtype)))
  np.testing.assert_array_equal(np.asarray(normed), np.asarray(norm(x_new)))


# (leading shape, d, S (None: no parts), dtype, tuning)
CASES = [
    ((1,), 96, 1, jnp.bfloat16, {}),
    ((5,), 96, 4, jnp.bfloat16, {}),
    ((16, 1), 896, 16, jnp.bfloat16, {}),
    ((16, 5), 896, 4, jnp.bfloat16, {}),
    ((5,), 896, None, jnp.bfloat16, {}),
    ((5,), 96, 16, jnp.bfloat16, dict(block_rows=4)),  # a half-masked block
    ((1,), 96, 4, jnp.bfloat16, dict(block_rows=4)),  # 3 of 4 rows masked
    ((16,), 96, None, jnp.bfloat16, dict(block_rows=16, num_warps=8)),
    ((1,), 96, 16, jnp.float32, {}),
    ((16, 5), 96, 4, jnp.float32, {}),
    ((80,), 896, 1, jnp.float32, {}),
    ((5,), 896, None, jnp.float32, {}),
    ((5,), 96, 16, jnp.float32, dict(block_rows=2)),
]


def case_id(case):
  lead, d, S, dtype, tuning = case
  tune = "".join(f"-{k}{v}" for k, v in tuning.items())
  return (f"{jnp.dtype(dtype).name}-{'x'.join(map(str, lead))}-d{d}-"
          f"S{S}{tune}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gpu_kernel_interpret(case):
  lead, d, S, dtype, tuning = case
  x, parts, w = make_inputs(1, lead, d, S, dtype)
  got = ops.residual_norm(x, parts, w, eps=EPS, impl="gpu", interpret=True,
                          **tuning)
  # f32: the row's sum of d squares in another order than XLA's is off by
  # up to ~sqrt(d) f32 ulps, half of that after the rsqrt
  check(got, x, parts, w, max_ulps=1 if dtype == jnp.bfloat16 else 16)


@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_no_parts_returns_x(impl):
  x, _, w = make_inputs(2, (5,), 96, None, jnp.bfloat16)
  x_new, normed = ops.residual_norm(x, None, w, eps=EPS, impl=impl,
                                    interpret=True)
  np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x))
  _, want = reference(x, None, w, eps=EPS)
  assert_normed_close(normed, want, 1)


def test_gpu_kernel_interpret_under_jit():
  x, parts, w = make_inputs(3, (16, 5), 96, 4, jnp.bfloat16)
  f = jax.jit(lambda *a: ops.residual_norm(*a, eps=EPS, impl="gpu",
                                           interpret=True))
  check(f(x, parts, w), x, parts, w, max_ulps=1)


@pytest.mark.parametrize("impl", ["auto", "tpu", "reference"])
def test_other_impls_run_the_reference(impl):
  x, parts, w = make_inputs(4, (5,), 96, 4, jnp.bfloat16)
  got = ops.residual_norm(x, parts, w, eps=EPS, impl=impl)
  want = residual_norm_reference(x, parts, w, eps=EPS)
  for g, r in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_bad_shapes_raise(impl):
  x, parts, w = make_inputs(5, (4, 2), 96, 3, jnp.bfloat16)
  call = lambda *a: ops.residual_norm(*a, eps=EPS, impl=impl, interpret=True)
  with pytest.raises(ValueError, match=r"parts must be \[S >= 1, \*x.shape\]"):
    call(x, parts[:, :, :1], w)  # trailing shape != x's
  with pytest.raises(ValueError, match=r"parts must be \[S >= 1"):
    call(x, parts[0], w)  # no S axis
  with pytest.raises(ValueError, match=r"parts must be \[S >= 1"):
    call(x, parts[:0], w)  # S = 0
  with pytest.raises(ValueError, match=r"weight must be bfloat16\[d=96\]"):
    call(x, parts, w[:48])
  with pytest.raises(ValueError, match=r"weight must be bfloat16\[d=96\]"):
    call(x, parts, w.astype(jnp.float32))


def test_bad_tuning_raises():
  x, parts, w = make_inputs(6, (5,), 96, 1, jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown tuning"):
    ops.residual_norm(x, parts, w, eps=EPS, impl="gpu", interpret=True,
                      block_cols=128)
  with pytest.raises(ValueError, match="power of two"):
    ops.residual_norm(x, parts, w, eps=EPS, impl="gpu", interpret=True,
                      block_rows=3)


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("d", [896, 3584])  # Qwen2.5-0.5B, Qwen2.5-7B
@pytest.mark.parametrize("lead", [(16, 1), (16, 5)])  # 16 rows, 80 rows
@pytest.mark.parametrize("S", [None, 1, 4, 16])
def test_gpu_kernel_compiled_model_shapes(d, lead, S):
  # Both sides compiled for the GPU: x_new is the same sum in the same order,
  # bit for bit; normed's sum of squares runs in another order (Triton may
  # also contract its multiply-adds into FMAs and round its division by d
  # differently), a few f32 ulps of the mean, which after the bf16 rounding
  # of x * rsqrt(.) and of the weight product moves an element by at most 2
  # ulps, and rarely.
  x, parts, w = make_inputs(7, lead, d, S, jnp.bfloat16)
  got = ops.residual_norm(x, parts, w, eps=EPS)
  check(got, x, parts, w, max_ulps=2)
