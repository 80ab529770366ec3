"""fused_mlp: the reference against the model's MLP; the Pallas GPU kernel
(interpret mode on CPU) against the reference; its errors; the compiled
kernel at the draft's shape on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.fused_mlp.ops import fused_mlp, fused_mlp_sum
from kernels.fused_mlp.reference import fused_mlp_reference
from kernel_cases import ON_GPU, rel_err


def operands(m, d, f, seed=0, dtype=jnp.bfloat16):
  kx, kg, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (m, d), jnp.float32).astype(dtype)
  w_gate_up = (jax.random.normal(kg, (d, 2 * f), jnp.float32) / np.sqrt(d)).astype(dtype)
  w_down = (jax.random.normal(kd, (f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
  return x, w_gate_up, w_down


def test_reference_partials_sum_to_the_models_mlp():
  from flax import nnx
  from conftest import tiny_hf_config
  from dustin_jax.config import ModelConfig
  from dustin_jax.models.decoder import MLP
  cfg = ModelConfig.from_hf(tiny_hf_config("qwen2", hidden_size=64, intermediate_size=96),
                            dtype="bfloat16")
  mlp = MLP(cfg, jnp.bfloat16, nnx.Rngs(0))
  x, w_gate_up, w_down = operands(7, 64, 96, seed=1)
  mlp.gate_up_proj.kernel[...] = w_gate_up
  mlp.down_proj.kernel[...] = w_down
  parts = fused_mlp_reference(x, w_gate_up, w_down, 3)
  assert parts.shape == (3, 7, 64) and parts.dtype == jnp.float32
  # the slices' sum is the MLP up to the f32 sum's order and one rounding
  assert rel_err(parts.sum(0).astype(jnp.bfloat16), mlp(x)) < 1e-2


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU's way to run the kernel")
@pytest.mark.parametrize("m,splits", [(16, 4), (5, 2)])
def test_gpu_kernel_interpret(m, splits):
  x, w_gate_up, w_down = operands(m, 128, 64 * splits, seed=m)
  tune = dict(splits=splits, block_k=64, block_d=64)
  got = fused_mlp(x, w_gate_up, w_down, impl="gpu", interpret=True, **tune)
  want = fused_mlp_reference(x, w_gate_up, w_down, splits)
  assert got.shape == want.shape == (splits, m, 128) and got.dtype == jnp.float32
  # the same bf16 roundings, up to the last bit of a SiLU
  assert rel_err(got, want) < 1e-2
  total = fused_mlp_sum(x, w_gate_up, w_down, impl="gpu", interpret=True, **tune)
  assert total.dtype == jnp.bfloat16 and rel_err(total, want.sum(0)) < 1e-2


def test_errors():
  x, w_gate_up, w_down = operands(4, 128, 96)
  with pytest.raises(ValueError, match="power of two"):
    fused_mlp(x, w_gate_up, w_down, splits=2)  # 48 columns a slice
  with pytest.raises(ValueError, match=r"w_gate_up must be \[D, 2F\]"):
    fused_mlp(x, w_gate_up[:, :-2], w_down)
  with pytest.raises(ValueError, match="multiple of block_k"):
    fused_mlp(x, w_gate_up, w_down, splits=3, block_k=96)
  with pytest.raises(ValueError, match=r"unknown tuning \['tile'\]"):
    fused_mlp(x, w_gate_up, w_down, tile=4)
  with pytest.raises(ValueError, match="share a dtype"):
    fused_mlp(x.astype(jnp.float32), w_gate_up, w_down, splits=3)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("m", [16, 32])
def test_gpu_kernel_compiled_draft_shape(m):
  # Qwen2.5-0.5B's MLP (D 896, F 4864) at a batch-16 draft pass (T = 1, 2)
  x, w_gate_up, w_down = operands(m, 896, 4864)
  got = fused_mlp(x, w_gate_up, w_down, impl="gpu")
  want = fused_mlp_reference(x, w_gate_up, w_down, got.shape[0])
  assert rel_err(got.sum(0), want.sum(0)) < 1e-2
