"""layer_finish: the reference vs the model's Block.finish; the Pallas GPU
stages (interpret mode on CPU, one call per stage) and the persistent kernel
(compiled, on a GPU) vs the reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.layer_finish import gpu
from kernels.layer_finish.ops import layer_finish
from kernels.layer_finish.reference import layer_finish_reference
from kernel_cases import ON_GPU, rel_err

EPS = 1e-6


def operands(seed, m, d, a, f, dtype=jnp.bfloat16):
  """x [m, d], attn [m, a] and weights scaled so every stage matters."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  normal = lambda k, shape, scale: (scale * jax.random.normal(k, shape)).astype(dtype)
  return (normal(ks[0], (m, d), 1.0), normal(ks[1], (m, a), 1.0),
          normal(ks[2], (a, d), a ** -0.5),
          (1.0 + 0.2 * jax.random.normal(ks[3], (d,))).astype(dtype),
          normal(ks[4], (d, 2 * f), d ** -0.5), normal(ks[5], (f, d), f ** -0.5))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_models_block_finish(dtype):
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.models.decoder import Block
  cfg = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=64, intermediate_size=48,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                    rope=RopeConfig(theta=1e4), rms_norm_eps=1e-5)
  block = Block(cfg, jnp.dtype(dtype), nnx.Rngs(3))
  block.post_attention_layernorm.weight.value = (
      1.0 + 0.2 * jax.random.normal(jax.random.PRNGKey(4), (64,))).astype(dtype)
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 3, 64), dtype)
  attn = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 4, 16), dtype)
  want = block.finish(x, attn)
  got = layer_finish_reference(
      x, attn.reshape(2, 3, 64), block.self_attn.o_proj.kernel[...],
      block.post_attention_layernorm.weight[...], block.mlp.gate_up_proj.kernel[...],
      block.mlp.down_proj.kernel[...], eps=cfg.rms_norm_eps)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# (m, d, a, f, tuning): row counts below, at and above a tile; programs that
# do not divide the units; several units per program in every stage
CASES = [
    (1, 64, 64, 48, dict(programs=2)),
    (5, 64, 96, 80, dict(programs=7, bk_o=64, bk_up=32, bk_d=32, bn_d=16)),  # F: 16 x 5
    (16, 128, 64, 64, dict(programs=5, bn_d=32, bn_s=32, bk_up=256)),  # 4 tiles, 1 slice
    (19, 32, 32, 96, dict(programs=4, bk_d=16, bn_d=16)),  # 2 tiles x 2 slices of 48 rows
    # every tile whole: unmasked slice loads in every stage
    (16, 64, 64, 128, dict(programs=4, bk_o=64, bk_up=64, bk_d=32, bn_d=32)),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,d,a,f,tuning", CASES)
def test_gpu_stages_interpret(m, d, a, f, tuning, dtype):
  args = operands(m, m, d, a, f, dtype)
  want = layer_finish_reference(*args, eps=EPS)
  got = layer_finish(*args, eps=EPS, impl="gpu", interpret=True, **tuning)
  assert got.shape == want.shape and got.dtype == want.dtype
  # f32: summation order only; bf16: a rounding of an intermediate may flip
  assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_leading_dims_and_reference_dispatch():
  x, attn, *w = operands(0, 6, 32, 32, 32)
  want = layer_finish_reference(x, attn, *w, eps=EPS)
  got = layer_finish(x.reshape(2, 3, 32), attn.reshape(2, 3, 32), *w, eps=EPS, impl="reference")
  np.testing.assert_array_equal(np.asarray(got).reshape(6, 32), np.asarray(want))


def test_bad_shapes_raise():
  x, attn, wo, nw, wgu, wd = operands(0, 4, 32, 32, 32)
  with pytest.raises(ValueError, match="w_gate_up"):
    layer_finish(x, attn, wo, nw, wgu[:, :48], wd, eps=EPS)
  with pytest.raises(ValueError, match="attn"):
    layer_finish(x, attn[:3], wo, nw, wgu, wd, eps=EPS)
  with pytest.raises(ValueError, match="bn_d = 24"):
    layer_finish(x, attn, wo, nw, wgu, wd, eps=EPS, impl="gpu", interpret=True, bn_d=24)
  with pytest.raises(ValueError, match="too few"):
    layer_finish(x, attn, wo, nw, wgu, wd, eps=EPS, impl="gpu", interpret=True, programs=1,
                 bn_d=16)
  x, attn, wo, nw, wgu, wd = operands(0, 4, 40, 32, 32)
  with pytest.raises(ValueError, match="multiples of 16"):
    layer_finish(x, attn, wo, nw, wgu, wd, eps=EPS, impl="gpu", interpret=True)


@pytest.mark.parametrize("d,a,f", [(896, 896, 4864), (2048, 2048, 8192)])
def test_default_tuning_spreads_the_weights(d, a, f):
  # the 0.5B / 1B drafts over 132 programs
  t = gpu.default_tuning(16, d, a, f, programs=132)
  s = gpu.Shape(m=16, M=16, D=d, A=a, F=f, P=132, **{k: t[k] for k in (
      "bk_o", "bk_up", "bk_d", "bn_o", "bn_d", "bn_s")}, eps=EPS)
  assert s.f_per_program % 8 == 0 and 132 * s.f_per_program >= f  # aligned, all of F
  assert 0.8 * 132 <= f / s.f_per_program and 2 * s.f_per_program <= s.up_tile <= 128
  programs_down = s.n_slices * (d // s.bn_d)
  assert 0.8 * 132 <= programs_down <= 132 and s.n_slices * s.down_rows >= f


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 32])
@pytest.mark.parametrize("d,a,f", [(896, 896, 4864), (2048, 2048, 8192)])
def test_gpu_kernel_compiled_draft_shapes(m, d, a, f):
  """The persistent kernel at the 0.5B / 1B draft shapes: the reference's
  values, and every program met every barrier (no timeout)."""
  args = operands(1, m, d, a, f)
  want = layer_finish_reference(*args, eps=EPS)
  got, counters = layer_finish(*args, eps=EPS, impl="gpu", return_counters=True)
  programs = gpu.default_tuning(m, d, a, f)["programs"]
  np.testing.assert_array_equal(np.asarray(counters), [3 * programs, 0])
  assert rel_err(got, want) < 1e-2
  staged = layer_finish(*args, eps=EPS, impl="gpu", persistent=False)
  assert rel_err(staged, want) < 1e-2
