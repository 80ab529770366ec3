"""skinny_matmul: the Mosaic GPU kernel (GPU interpret mode on CPU) against
its jnp reference; its lowering for CUDA at the draft's and the verify's
projection shapes (Mosaic GPU's layout rules run on any host); the compiled
kernel on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.skinny_matmul.ops import skinny_matmul, skinny_matmul_partials
from kernels.skinny_matmul.reference import (skinny_matmul_partials_reference,
                                             skinny_matmul_reference)
from kernel_cases import ON_GPU


def operands(m, k, n, seed=0, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  scale = jnp.asarray(rng.uniform(0.5, 2.0, m), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  return x, w, scale, bias


def assert_close(out, ref):
  """Equal up to the one bf16 rounding of each output (both accumulate in f32)."""
  assert out.shape == ref.shape and out.dtype == ref.dtype
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=1e-2, atol=1e-2)


def test_reference_is_the_scaled_biased_product():
  x, w, scale, bias = operands(5, 32, 24)
  want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * np.asarray(scale)[:, None]
  want += np.asarray(bias)
  assert_close(skinny_matmul_reference(x, w, scale, bias), jnp.asarray(want, jnp.bfloat16))
  assert_close(skinny_matmul_reference(x, w), (x.astype(jnp.float32) @ w.astype(jnp.float32)
                                               ).astype(jnp.bfloat16))


def test_partials_reference_sums_to_the_product():
  x, w, _, _ = operands(5, 96, 40)
  parts = skinny_matmul_partials_reference(x, w, 4)
  assert parts.shape == (4, 5, 40) and parts.dtype == jnp.float32
  xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
  # part p is the product of the p-th slice of K
  np.testing.assert_allclose(parts[2], xf[:, 48:72] @ wf[48:72], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(parts.sum(0), xf @ wf, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU's way to run the kernel")
@pytest.mark.parametrize("m,k,n,tile_n,epilogue", [
    (16, 256, 128, 64, True),    # a draft pass's rows, two column tiles
    (5, 128, 96, 32, False),     # a batch smaller than a tile, no epilogue
    (80, 128, 64, 64, True),     # a verify's rows: two 64-row operands
])
def test_gpu_kernel_interpret(m, k, n, tile_n, epilogue):
  x, w, scale, bias = operands(m, k, n, seed=m)
  args = (x, w, scale, bias) if epilogue else (x, w)
  out = skinny_matmul(*args, impl="gpu", interpret=True, tile_n=tile_n, tile_k=64, stages=2)
  assert_close(out, skinny_matmul_reference(*args))


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU's way to run the kernel")
@pytest.mark.parametrize("m,splits", [(16, 2), (5, 4)])
def test_partials_kernel_interpret(m, splits):
  x, w, scale, bias = operands(m, 256, 128, seed=splits)
  parts = skinny_matmul_partials(x, w, splits=splits, impl="gpu", interpret=True, stages=2)
  want = skinny_matmul_partials_reference(x, w, splits)
  assert parts.shape == want.shape and parts.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(parts), np.asarray(want), rtol=1e-4, atol=1e-4)
  # summed, with the epilogue XLA applies after the sum
  assert_close(skinny_matmul(x, w, scale, bias, impl="gpu", interpret=True, stages=2,
                             splits=splits),
               skinny_matmul_reference(x, w, scale, bias))


@pytest.mark.parametrize("m,k,n,splits", [(16, 896, 1152, 1), (80, 3584, 4608, 1),
                                          (16, 4864, 896, 4)],
                         ids=["draft-0.5b-qkv", "verify-7b-qkv", "draft-0.5b-down-split4"])
def test_lowers_for_cuda(m, k, n, splits):
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
  scale, bias = jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)
  f = lambda *a: skinny_matmul(*a, impl="gpu", splits=splits)
  text = jax.jit(f).trace(x, w, scale, bias).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_shapes_the_kernel_cannot_take_are_refused():
  x, w, _, _ = operands(4, 96, 64)
  with pytest.raises(ValueError, match="multiple of splits x tile_k = 1 x 64"):
    skinny_matmul(x, w, impl="gpu", interpret=True)
  with pytest.raises(ValueError, match="bf16 or f16"):
    skinny_matmul(x[:, :64].astype(jnp.float32), w[:64].astype(jnp.float32), impl="gpu")
  with pytest.raises(ValueError, match="multiple of splits x tile_k = 4 x 64"):
    skinny_matmul_partials(x[:, :64], w[:64], splits=4, impl="gpu", interpret=True)
  with pytest.raises(ValueError, match="unknown impl"):
    skinny_matmul(x, w, impl="triton")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m,k,n", [(16, 896, 1152), (16, 896, 9728), (80, 3584, 4608),
                                   (80, 18944, 3584)])
def test_gpu_kernel_compiled(m, k, n):
  x, w, scale, bias = operands(m, k, n)
  assert_close(skinny_matmul(x, w, scale, bias, impl="gpu"),
               skinny_matmul_reference(x, w, scale, bias))


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m,k,n,splits", [(16, 4864, 896, 4), (16, 896, 896, 7),
                                          (80, 18944, 3584, 2)])
def test_partials_kernel_compiled(m, k, n, splits):
  x, w, scale, bias = operands(m, k, n)
  parts = skinny_matmul_partials(x, w, splits=splits, impl="gpu")
  np.testing.assert_allclose(np.asarray(parts), np.asarray(skinny_matmul_partials_reference(
      x, w, splits)), rtol=1e-3, atol=1e-3)
  assert_close(skinny_matmul(x, w, scale, bias, impl="gpu", splits=splits),
               skinny_matmul_reference(x, w, scale, bias))
