"""kernels/stream_matmul: the Mosaic GPU kernel against its reference
(interpreted on CPU, compiled on a Hopper GPU), the reference against plain
jnp, and the checks of the public entry."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.stream_matmul.gpu import stream_matmul_gpu
from kernels.stream_matmul.ops import stream_matmul
from kernels.stream_matmul.reference import stream_matmul_reference

ON_GPU = jax.default_backend() == "gpu"


def operands(seed, m, k, n, dtype=jnp.bfloat16):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def as_f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


def bias_of(options, n, dtype=jnp.bfloat16):
  if not options.get("bias"):
    return None
  return jax.random.normal(jax.random.key(n), (n,), jnp.float32).astype(dtype)


def run_case(x, w, options, **kw):
  """(kernel, reference) of one case; options: the kernel's keywords and
  bias=True for a random bias."""
  options = dict(options)
  bias = bias_of(options, w.shape[1])
  options.pop("bias", None)
  got = stream_matmul(x, w, bias, impl="gpu", **options, **kw)
  want = stream_matmul_reference(x, w, bias, swiglu=options.get("swiglu", False),
                                 splits=options.get("splits", 1))
  return got, want


# ---------------------------------------------------------------- reference
def test_reference_is_the_product_its_swiglu_and_its_partials():
  x, w = operands(0, 5, 256, 256)
  xf, wf = as_f32(x), as_f32(w)
  np.testing.assert_allclose(as_f32(stream_matmul_reference(x, w)), xf @ wf,
                             rtol=2e-2, atol=2e-2)
  parts = stream_matmul_reference(x, w, splits=4)
  assert parts.shape == (4, 5, 256) and parts.dtype == jnp.float32
  np.testing.assert_allclose(parts[1], xf[:, 64:128] @ wf[64:128], rtol=1e-5, atol=1e-5)
  # swiglu over blocks of 64: [gate_0 | up_0 | gate_1 | up_1], silu(gate) * up
  y = xf @ wf
  gate = np.concatenate([y[:, 0:64], y[:, 128:192]], axis=1)
  up = np.concatenate([y[:, 64:128], y[:, 192:256]], axis=1)
  want = gate / (1 + np.exp(-gate)) * up
  np.testing.assert_allclose(as_f32(stream_matmul_reference(x, w, swiglu=True, block=64)),
                             want, rtol=2e-2, atol=2e-2)
  bias = jnp.linspace(-1, 1, 256).astype(jnp.bfloat16)
  np.testing.assert_allclose(as_f32(stream_matmul_reference(x, w, bias)),
                             xf @ wf + as_f32(bias), rtol=2e-2, atol=2e-2)


# ------------------------------------------------- the kernel, interpreted
# (m, k, n, options): 16 rows (a draft pass at batch 16) as a plain product,
# with the SwiGLU epilogue, with a bias, and as f32 partials over 2 slices of K; 5 rows
# (padded to 8 for the copies, 3 pipeline slots over 4 steps).
KERNEL_CASES = [
    (16, 256, 256, dict(tile_k=64, stages=2)),
    (16, 256, 256, dict(tile_k=64, stages=2, swiglu=True)),
    (16, 256, 192, dict(tile_k=64, stages=2, bias=True)),
    (16, 256, 128, dict(tile_k=64, stages=2, splits=2)),
    (5, 256, 128, dict(tile_k=64, stages=3)),
]


@pytest.mark.parametrize("m,k,n,options", KERNEL_CASES)
def test_kernel_interpreted_equals_reference(m, k, n, options):
  x, w = operands(m + k + n, m, k, n)
  got, want = run_case(x, w, options, interpret=True)
  assert got.shape == want.shape and got.dtype == want.dtype
  # same f32 products and epilogue; the kernel sums K in its own order
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=1e-2, atol=1e-2)


def test_kernel_lowers_to_mosaic_gpu():
  x = jax.ShapeDtypeStruct((16, 896), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((896, 9728), jnp.bfloat16)
  fn = functools.partial(stream_matmul_gpu, swiglu=True, tile_k=64, stages=4)  # 188 KB of smem
  text = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  # the bias epilogue: its broadcast over rows lowers too
  w = jax.ShapeDtypeStruct((896, 1152), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((1152,), jnp.bfloat16)
  fn = functools.partial(stream_matmul_gpu, tile_k=64, stages=6)
  text = jax.jit(fn).trace(x, w, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# ---------------------------------------------------------------- ops
def test_ops_checks_and_dispatch():
  x, w = operands(1, 16, 256, 256)
  if not ON_GPU:  # auto: the reference
    np.testing.assert_array_equal(as_f32(stream_matmul(x, w)),
                                  as_f32(stream_matmul_reference(x, w)))
  with pytest.raises(ValueError, match="1..64 rows"):
    stream_matmul(jnp.zeros((65, 256), jnp.bfloat16), w)
  with pytest.raises(ValueError, match="bf16 or f16"):
    stream_matmul(x.astype(jnp.float32), w.astype(jnp.float32))
  with pytest.raises(ValueError, match="multiple of 128"):
    stream_matmul(x, w[:, :192], swiglu=True)
  with pytest.raises(ValueError, match="splits x tile_k"):
    stream_matmul(x, w, splits=3, tile_k=64)
  with pytest.raises(ValueError, match="splits must be 1"):
    stream_matmul(x, w, swiglu=True, splits=2)
  with pytest.raises(ValueError, match="a bias is"):
    stream_matmul(x, w, jnp.zeros((256,), jnp.bfloat16), splits=2)
  with pytest.raises(ValueError, match="a bias is"):
    stream_matmul(x, w, jnp.zeros((128,), jnp.bfloat16))
  with pytest.raises(ValueError, match="shared memory"):
    stream_matmul(*operands(2, 16, 4864, 128), impl="gpu", tile_k=64)  # x alone: 622 KB


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")


@gpu_only
@pytest.mark.parametrize("m,k,n,options", [
    (16, 896, 1152, dict(bias=True, stages=6)),      # 0.5B q/k/v + bias
    (16, 896, 896, dict(tile_k=64, stages=6)),       # 0.5B o
    (16, 896, 9728, dict(swiglu=True)),              # 0.5B gate/up + SwiGLU
    (16, 4864, 896, dict(tile_k=64, splits=4)),      # 0.5B down, f32 partials
    (1, 896, 896, dict()),
    (64, 896, 1152, dict()),
])
def test_kernel_compiled_equals_reference(m, k, n, options):
  x, w = operands(m * 7 + n, m, k, n)
  got, want = run_case(x, w, options)
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=1e-2, atol=1e-2)
