"""skinny_matmul: the reference vs the decoder's unfused modules (RMSNorm,
Linear, the gated MLP); the Pallas GPU kernel (interpret mode on CPU) vs the
reference; its lowering to Triton for a GPU, checked on any machine."""
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.skinny_matmul import ops
from kernels.skinny_matmul.gpu import skinny_matmul_gpu
from kernels.skinny_matmul.reference import skinny_matmul_reference
from kernel_cases import ON_GPU, rel_err


def operands(seed, M, K, N, *, norm=False, bias=False, glu=False, residual=False,
             dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  n_out = N // 2 if glu else N
  cast = lambda a: a.astype(dtype)
  x = cast(jax.random.normal(ks[0], (M, K)) * 2.0)
  w = cast(jax.random.normal(ks[1], (K, N)) / np.sqrt(K))
  kw = dict(glu=glu)
  if norm:
    kw["norm_weight"] = cast(1.0 + 0.2 * jax.random.normal(ks[2], (K,)))
    kw["eps"] = 1e-5
  if bias:
    kw["bias"] = cast(jax.random.normal(ks[3], (N,)))
  if residual:
    kw["residual"] = cast(jax.random.normal(ks[4], (M, n_out)))
  return x, w, kw


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_equals_the_decoders_modules(dtype):
  """The four fused projections of a layer-pass, bit-equal to the model's
  modules: norm + q/k/v (+ bias), o + residual, norm + gate/up + SiLU x up,
  down + residual."""
  from dustin_jax.models.decoder import MLP, Linear, RMSNorm
  cfg = types.SimpleNamespace(hidden_size=32, intermediate_size=24)  # what MLP reads
  rngs = nnx.Rngs(0)
  norm = RMSNorm(32, 1e-5, dtype)
  norm.weight[...] = (1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(1), (32,))).astype(dtype)
  qkv = Linear(32, 64, bias=True, dtype=dtype, rngs=rngs)
  qkv.bias[...] = jax.random.normal(jax.random.PRNGKey(2), (64,)).astype(dtype)
  o = Linear(32, 32, bias=False, dtype=dtype, rngs=rngs)
  mlp = MLP(cfg, dtype, rngs)
  x = (2.0 * jax.random.normal(jax.random.PRNGKey(3), (5, 32))).astype(dtype)
  a = jax.random.normal(jax.random.PRNGKey(4), (5, 32)).astype(dtype)
  same = np.testing.assert_array_equal
  same(skinny_matmul_reference(x, qkv.kernel[...], norm_weight=norm.weight[...], eps=1e-5,
                               bias=qkv.bias[...]), qkv(norm(x)))
  same(skinny_matmul_reference(a, o.kernel[...], residual=x), x + o(a))
  h = skinny_matmul_reference(x, mlp.gate_up_proj.kernel[...], norm_weight=norm.weight[...],
                              eps=1e-5, glu=True)
  same(skinny_matmul_reference(h, mlp.down_proj.kernel[...], residual=x), x + mlp(norm(x)))


# (M, K, N, fused neighbours, tuning): masked rows (M < 16, M not a power of
# two), masked columns (N_out not a multiple of block_n), a partial last K
# tile, K split over programs (a partial last split too)
CASES = [
    (16, 128, 96, dict(norm=True, bias=True), dict(block_k=32, block_n=32)),
    (5, 96, 64, dict(norm=True, glu=True), dict(block_k=32, block_n=16)),
    (16, 64, 80, dict(glu=True), dict(block_k=64, block_n=16)),
    (3, 100, 40, dict(residual=True), dict(block_k=32, block_n=16)),
    (16, 256, 48, dict(residual=True, bias=True), dict(block_k=32, block_n=16, splits=4)),
    (7, 200, 32, dict(residual=True), dict(block_k=32, block_n=16, splits=3)),
    (20, 64, 32, dict(), {}),
    (16, 128, 64, dict(norm=True, bias=True), dict(block_k=32, block_n=16, splits=2)),
    (5, 96, 64, dict(norm=True, glu=True, residual=True), dict(block_k=32, block_n=16, splits=3)),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_gpu_kernel_interpret(case, dtype):
  M, K, N, fused, tuning = case
  x, w, kw = operands(0, M, K, N, dtype=dtype, **fused)
  out = ops.skinny_matmul(x, w, impl="gpu", interpret=True, **kw, **tuning)
  ref = skinny_matmul_reference(x, w, **kw)
  assert out.shape == ref.shape and out.dtype == dtype
  # the kernel rounds once, at the end; the reference after each module
  assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_auto_dispatch_and_errors():
  x, w, kw = operands(1, 4, 32, 16, norm=True, residual=True)
  got = ops.skinny_matmul(x, w, **kw)
  want = skinny_matmul_reference(x, w, **kw)
  if ON_GPU:
    assert rel_err(got, want) < 1e-5
  else:
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="even number of columns"):
    ops.skinny_matmul(x, w[:, :15], glu=True)
  with pytest.raises(ValueError, match="glu with a bias"):
    ops.skinny_matmul(x, w, glu=True, bias=jnp.zeros((16,)))
  with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
    ops.skinny_matmul(x, w[:31])
  with pytest.raises(ValueError, match=r"residual must be \[M, N_out\]"):
    ops.skinny_matmul(x, w, glu=True, residual=kw["residual"])
  with pytest.raises(ValueError, match="norm_weight"):
    ops.skinny_matmul(x, w, norm_weight=jnp.ones((16,)))
  with pytest.raises(ValueError, match="dtype"):
    ops.skinny_matmul(x, w.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="power of two"):
    ops.skinny_matmul(x, w, impl="gpu", interpret=True, block_k=48)


def test_auto_leaves_many_rows_to_xla():
  """More than 64 rows are not a decode step's: "auto" runs the reference."""
  x, w, kw = operands(2, 65, 32, 16, residual=True)
  np.testing.assert_array_equal(ops.skinny_matmul(x, w, **kw),
                                skinny_matmul_reference(x, w, **kw))


# the Qwen2.5-0.5B draft's four projections at batch 16 (M 16) and at the
# first pass of two tokens (M 32)
DRAFT = [(896, 1152, dict(norm=True, bias=True)), (896, 896, dict(residual=True)),
         (896, 9728, dict(norm=True, glu=True)), (4864, 896, dict(residual=True))]


@pytest.mark.parametrize("K, N, fused", DRAFT)
def test_lowers_to_triton(K, N, fused):
  """The kernel lowers for a GPU at the draft's shapes (Pallas -> Triton IR,
  on any machine; the Triton compile itself needs the GPU)."""
  x, w, kw = operands(3, 16, K, N, dtype=jnp.bfloat16, **fused)
  f = jax.jit(lambda x, w: skinny_matmul_gpu(x, w, **kw))
  text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert "skinny_matmul" in text and "triton" in text


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel: GPU only")
@pytest.mark.parametrize("M", [1, 16, 32])
@pytest.mark.parametrize("K, N, fused", DRAFT)
def test_gpu_kernel_compiled_draft_shapes(M, K, N, fused):
  x, w, kw = operands(4, M, K, N, dtype=jnp.bfloat16, **fused)
  out = jax.jit(lambda x, w: ops.skinny_matmul(x, w, impl="gpu", **kw))(x, w)
  ref = skinny_matmul_reference(x, w, **kw)
  assert rel_err(out, ref) < 1e-2
