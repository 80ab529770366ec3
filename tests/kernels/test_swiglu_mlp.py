"""kernels/swiglu_mlp: the streamed layout, the Mosaic GPU kernel against its
reference (interpreted on CPU, compiled on a Hopper GPU), the public entry's
checks, and a decoder whose MLPs run streamed."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.common import is_hopper
from kernels.swiglu_mlp.gpu import PREFETCH_ROWS, prefetch_boxes, swiglu_mlp_gpu
from kernels.swiglu_mlp.ops import fits, swiglu_mlp
from kernels.swiglu_mlp.reference import stream_layout, swiglu_mlp_reference, unstream_layout

ON_HOPPER = jax.default_backend() == "gpu" and is_hopper()


def operands(seed, m, d, f, dtype=jnp.bfloat16):
  """x [m, d], gate_up [d, 2f] (gate and up interleaved), down [f, d], residual [m, d]."""
  kx, kg, kd, kr = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (m, d), jnp.float32).astype(dtype)
  gate_up = (jax.random.normal(kg, (d, 2 * f), jnp.float32) / np.sqrt(d)).astype(dtype)
  down = (jax.random.normal(kd, (f, d), jnp.float32) / np.sqrt(f)).astype(dtype)
  residual = jax.random.normal(kr, (m, d), jnp.float32).astype(dtype)
  return x, gate_up, down, residual


def as_f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


# ------------------------------------------------------ layout and reference
def test_stream_layout_holds_each_programs_tiles_in_streaming_order():
  x, gate_up, down, residual = operands(0, 4, 256, 128)
  w = stream_layout(gate_up, down)
  assert w.shape == (2, 64 * (256 // 64 + 256 // 128), 128)
  g, u = as_f32(gate_up)[:, 0::2], as_f32(gate_up)[:, 1::2]
  # program 1, gate/up tile 2: rows 128..191 of D, gate then up of F block 1
  np.testing.assert_array_equal(as_f32(w[1, 128:192, :64]), g[128:192, 64:128])
  np.testing.assert_array_equal(as_f32(w[1, 128:192, 64:]), u[128:192, 64:128])
  # program 0, down tile 1 (after the 4 gate/up tiles): F rows 0..63, D columns 128..255
  np.testing.assert_array_equal(as_f32(w[0, 5 * 64:6 * 64]), as_f32(down)[0:64, 128:256])
  back = unstream_layout(w, 256)
  np.testing.assert_array_equal(as_f32(back[0]), as_f32(gate_up))
  np.testing.assert_array_equal(as_f32(back[1]), as_f32(down))
  with pytest.raises(ValueError, match="multiple|%"):
    stream_layout(gate_up[:192], down[:, :192])  # D = 192


def test_reference_is_the_residual_plus_the_swiglu_mlp():
  x, gate_up, down, residual = operands(1, 5, 256, 128)
  xf, gu, dn = as_f32(x), as_f32(gate_up), as_f32(down)
  y = xf @ gu
  h = as_f32(jnp.asarray(y[:, 0::2] / (1 + np.exp(-y[:, 0::2])) * y[:, 1::2], jnp.bfloat16))
  got = swiglu_mlp_reference(x, stream_layout(gate_up, down), residual)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(as_f32(got), as_f32(residual) + h @ dn, rtol=1e-4, atol=1e-4)


# ------------------------------------------------- the kernel, interpreted
# (m, d, f, stages): 16 rows (a draft pass at batch 16), two programs, the
# pipeline's slots fewer than its 6 steps; 5 rows (padded to 8) over three
# programs and 3 steps
@pytest.mark.parametrize("m,d,f,stages", [(16, 256, 128, 2), (5, 128, 192, 3)])
def test_kernel_interpreted_equals_reference(m, d, f, stages):
  x, gate_up, down, residual = operands(m + d + f, m, d, f)
  w = stream_layout(gate_up, down)
  # the prefetch, a hint, is left out in interpret mode
  got = swiglu_mlp(x, w, residual, prefetch=(gate_up, w), impl="gpu", interpret=True,
                   stages=stages)
  want = swiglu_mlp_reference(x, w, residual)
  assert got.shape == (m, d) and got.dtype == jnp.float32
  # the same f32 products and rounding of h; the kernel sums K in its own order
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=2e-3, atol=2e-3)


def test_kernel_lowers_to_one_mosaic_gpu_call_that_adds_into_the_residual():
  """At the 0.5B draft's shapes: the residual's f32 copy is the call's
  aliased output and the down products reach it by TMA reduce-adds."""
  x = jax.ShapeDtypeStruct((16, 896), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4864 // 64, 64 * (896 // 64 + 896 // 128), 128), jnp.bfloat16)
  text = jax.jit(swiglu_mlp_gpu).trace(x, w, x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
  assert "output_operand_alias" in text and "cp.reduce.async.bulk.tensor" in text
  assert "cp.async.bulk.prefetch" not in text


@pytest.mark.parametrize("n,programs", [(8064, 76), (6272, 76), (102144, 76), (5, 76), (300, 1)])
def test_prefetch_boxes_cover_the_array_within_its_rows(n, programs):
  covered = np.zeros(n, int)
  for p in range(programs):
    starts, box = prefetch_boxes(n, programs, p)
    assert 1 <= box <= PREFETCH_ROWS
    for start in map(int, starts):
      assert 0 <= start <= n - box
      covered[start:start + box] += 1
  assert covered.min() == 1  # every row, and (but for the clamped last boxes) once
  assert covered.sum() <= n + programs * box


def test_kernel_prefetches_the_arrays_it_is_given_to_l2():
  """The next layer's q/k/v [896, 1152] and o [896, 896] as the kernel's
  extra operands, viewed as rows of 128, sent to L2 by TMA prefetches."""
  x = jax.ShapeDtypeStruct((16, 896), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4864 // 64, 64 * (896 // 64 + 896 // 128), 128), jnp.bfloat16)
  prefetch = (jax.ShapeDtypeStruct((896 * 1152 // 128, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((896 * 896 // 128, 128), jnp.bfloat16))
  text = jax.jit(swiglu_mlp_gpu).trace(x, w, x, prefetch).lower(
      lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
  assert "cp.async.bulk.prefetch.tensor.2d.L2.global.tile" in text


# ---------------------------------------------------------------- ops
def test_ops_checks_and_dispatch():
  x, gate_up, down, residual = operands(2, 16, 256, 128)
  w = stream_layout(gate_up, down)
  if jax.default_backend() == "cpu":  # auto: the reference
    np.testing.assert_array_equal(as_f32(swiglu_mlp(x, w, residual)),
                                  as_f32(swiglu_mlp_reference(x, w, residual)))
  with pytest.raises(ValueError, match="stream_layout"):
    swiglu_mlp(x, w[:, :-64], residual)
  with pytest.raises(ValueError, match="residual"):
    swiglu_mlp(x, w, residual[:8])
  with pytest.raises(ValueError, match="one dtype"):
    swiglu_mlp(x.astype(jnp.float32), w, residual)
  with pytest.raises(ValueError, match="bf16 or f16"):
    swiglu_mlp(x.astype(jnp.float32), w.astype(jnp.float32), residual, impl="gpu")
  with pytest.raises(ValueError, match="1..64 rows"):
    swiglu_mlp(jnp.zeros((65, 256), jnp.bfloat16), w, jnp.zeros((65, 256)), impl="gpu")
  # the 0.5B and 1B drafts at batch 16; not 80 rows, D = 960 or 8 stages
  assert fits(16, 896, jnp.bfloat16) and fits(16, 2048, jnp.bfloat16)
  assert not fits(80, 896, jnp.bfloat16) and not fits(16, 960, jnp.bfloat16)
  assert not fits(16, 896, jnp.bfloat16, stages=8)


# ----------------------------------------------------- the decoder, streamed
def test_decoder_with_streamed_mlps_equals_the_decoder():
  """`Decoder.stream_mlps` keeps the forward: at decode rows through the
  kernel on a Hopper GPU (its reference elsewhere), at prefill rows (> 64)
  through the reference."""
  from dustin_jax.cache import KVCache
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.models.decoder import Decoder

  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=128, intermediate_size=192,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    rope=RopeConfig(theta=1e6), qkv_bias=True, dtype="bfloat16")
  model = Decoder(cfg, rngs=nnx.Rngs(3))
  streamed, prefetching = Decoder(cfg, rngs=nnx.Rngs(3)), Decoder(cfg, rngs=nnx.Rngs(3))
  streamed.stream_mlps()
  prefetching.stream_mlps(prefetch_next_layer=True)
  assert streamed.layers[0].mlp.gate_up_proj is None
  assert [w.shape for w in prefetching.layers[1].attention_weights()] == [(128, 256), (128, 128)]
  cache = KVCache.init(cfg, batch=2, max_len=96)
  for tokens in (jax.random.randint(jax.random.key(0), (2, 40), 0, 101),  # 80 rows
                 jax.random.randint(jax.random.key(1), (2, 3), 0, 101)):  # 6 rows
    want, *_ = model(tokens, cache)
    got, *_ = streamed(tokens, cache)
    # bf16 activations: the kernel adds the MLP to the residual in f32 and rounds once
    np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=3e-2, atol=3e-2)
    # the prefetches change no value
    np.testing.assert_array_equal(as_f32(prefetching(tokens, cache)[0]), as_f32(got))


def test_draft_mlp_mode_resolves_to_what_can_run():
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.decoding import resolve_draft_mlp
  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=896, intermediate_size=4864,
                    num_layers=1, num_heads=14, num_kv_heads=2, head_dim=64,
                    rope=RopeConfig(theta=1e6), dtype="bfloat16")
  assert resolve_draft_mlp("auto", cfg) == ("kernel_prefetch" if ON_HOPPER else "xla")
  assert resolve_draft_mlp("kernel", cfg) == "kernel" and resolve_draft_mlp("xla", cfg) == "xla"
  assert resolve_draft_mlp("kernel_prefetch", cfg) == "kernel_prefetch"
  assert resolve_draft_mlp("auto", cfg.replace(hidden_size=960)) == "xla"
  for mode in ("kernel", "kernel_prefetch"):
    with pytest.raises(ValueError, match="hidden_size=960"):
      resolve_draft_mlp(mode, cfg.replace(hidden_size=960))
  with pytest.raises(ValueError, match="one of"):
    resolve_draft_mlp("triton", cfg)


def test_with_draft_mlp_lays_out_the_draft_as_its_resolved_mode_says():
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.decoding import Model
  from dustin_jax.models.decoder import Decoder
  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=128, intermediate_size=192,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                    rope=RopeConfig(theta=1e6), dtype="bfloat16")
  model = Model(cfg, *nnx.split(Decoder(cfg, rngs=nnx.Rngs(0))))
  assert model.with_draft_mlp("xla") is model
  for mode, prefetch in (("kernel", False), ("kernel_prefetch", True)):
    module = nnx.merge(*model.with_draft_mlp(mode)[1:])
    assert module.layers[0].mlp.streamed is not None
    assert module.prefetch_next_layer is prefetch
  with pytest.raises(ValueError, match="resolved draft_mlp"):  # "auto" is resolved first
    model.with_draft_mlp("auto")


# ------------------------------------------------------- compiled (Hopper)
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (TMA, WGMMA)")
@pytest.mark.parametrize("m", [16, 5])
def test_kernel_compiled_equals_reference(m):
  x, gate_up, down, residual = operands(m, m, 896, 4864)  # the 0.5B draft's MLP
  w = stream_layout(gate_up, down)
  got = jax.jit(swiglu_mlp)(x, w, residual)
  want = swiglu_mlp_reference(x, w, residual)
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=2e-3, atol=2e-3)
  # prefetching another layer's weights (and its own) to L2 changes nothing
  prefetched = jax.jit(swiglu_mlp)(x, w, residual, prefetch=(gate_up, down[::-1], w))
  np.testing.assert_allclose(as_f32(prefetched), as_f32(want), rtol=2e-3, atol=2e-3)
