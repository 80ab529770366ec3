"""kernels/layer_seam: the streamed layout, the reference against the
layer's own math, the Mosaic GPU kernel's lowering (CPU) and its results
against the reference (compiled, on a Hopper GPU), the public entry's
checks, and a streaming draft whose seams run as one kernel per layer."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels.common import is_hopper
from kernels.layer_seam.gpu import fits, layer_seam_gpu, programs_needed
from kernels.layer_seam.ops import layer_seam
from kernels.layer_seam.reference import (SeamDims, layer_seam_reference, seam_layout,
                                          unseam_layout)

ON_HOPPER = jax.default_backend() == "gpu" and is_hopper()
QWEN_05B = SeamDims(d=896, a=896, f=4864, nq=1152)


def weights(seed, dims: SeamDims, layers: int, dtype=jnp.bfloat16):
  """Per layer (o [A, D], gate_up [D, 2F], down [F, D], qkv [D, Nq]), scaled
  so that each product keeps its input's scale."""
  out = []
  for key in jax.random.split(jax.random.key(seed), layers):
    ko, kg, kd, kq = jax.random.split(key, 4)
    out.append(tuple(
        (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)
        for k, shape in ((ko, (dims.a, dims.d)), (kg, (dims.d, 2 * dims.f)),
                         (kd, (dims.f, dims.d)), (kq, (dims.d, dims.nq)))))
  return out


def activations(seed, dims: SeamDims, m: int, mp: int):
  """r [Mp, D] f32 and attn [Mp, A] bf16, rows past m zero."""
  kr, ka = jax.random.split(jax.random.key(seed))
  pad = ((0, mp - m), (0, 0))
  r = jnp.pad(jax.random.normal(kr, (m, dims.d), jnp.float32), pad)
  attn = jnp.pad(jax.random.normal(ka, (m, dims.a), jnp.float32).astype(jnp.bfloat16), pad)
  return r, attn


def as_f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


# ------------------------------------------------------ layout and reference
def test_seam_layout_holds_each_programs_blocks_in_streaming_order():
  dims = SeamDims(d=256, a=256, f=192, nq=384)
  (o, gate_up, down, qkv), second = weights(0, dims, 2, jnp.float32)
  stream = jnp.concatenate([seam_layout(o, gate_up, down, qkv), seam_layout(*second)])
  assert stream.shape == (2 * dims.blocks * 64, 128)
  # owner 1, step 1: o rows 128..191 and 192..255 of columns 64..127, side by side
  block = as_f32(stream[(dims.o_steps + 1) * 64:(dims.o_steps + 2) * 64])
  np.testing.assert_array_equal(block[:, :64], as_f32(o)[128:192, 64:128])
  np.testing.assert_array_equal(block[:, 64:], as_f32(o)[192:256, 64:128])
  # q/k/v tile p = n * D/64 + k (n = 2, k = 3): rows 192..255, columns 256..383
  at = (dims.o_blocks + dims.mlp_blocks + 2 * (dims.d // 64) + 3) * 64
  np.testing.assert_array_equal(as_f32(stream[at:at + 64]), as_f32(qkv)[192:256, 256:384])
  for layer, want in enumerate(((o, gate_up, down, qkv), second)):
    for got, w in zip(unseam_layout(stream, dims, layer), want):
      np.testing.assert_array_equal(as_f32(got), as_f32(w))
  with pytest.raises(ValueError, match="multiples"):
    seam_layout(o[:, :192], gate_up[:192], down[:, :192], qkv[:192])  # D = 192


def test_reference_is_the_layer_seam_math():
  """o and the residual, the norm as a row scale, the SwiGLU MLP and the
  residual, the next q/k/v: against the layer's own ops in f32 (bf16
  roundings where the model rounds)."""
  dims = SeamDims(d=256, a=128, f=192, nq=256)
  w = weights(1, dims, 2)
  stream = jnp.concatenate([seam_layout(*ws) for ws in w])
  r, attn = activations(2, dims, 5, 8)
  eps = 1e-6
  got_r, got_qkv = layer_seam_reference(r, attn, stream, layer=0, dims=dims, has_next=True,
                                        eps=eps)
  o, gate_up, down, _ = (as_f32(x) for x in w[0])
  x_mid = as_f32(r) + as_f32(attn) @ o
  normed = x_mid / np.sqrt(np.mean(x_mid ** 2, axis=-1, keepdims=True) + eps)
  xb = as_f32(jnp.asarray(x_mid, jnp.bfloat16))
  y = xb @ gate_up * (normed / np.where(x_mid == 0, 1, x_mid))[:, :1]  # the norm as a row scale
  h = as_f32(jnp.asarray(y[:, 0::2] / (1 + np.exp(-y[:, 0::2])) * y[:, 1::2], jnp.bfloat16))
  want_r = x_mid + h @ down
  want_qkv = as_f32(jnp.asarray(want_r, jnp.bfloat16)) @ as_f32(w[1][3])
  np.testing.assert_allclose(as_f32(got_r)[:5], want_r[:5], rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(as_f32(got_qkv)[:5], want_qkv[:5], rtol=2e-2, atol=2e-2)
  # the padded rows stay zero
  assert not np.any(as_f32(got_r)[5:]) and not np.any(as_f32(got_qkv)[5:])
  no_next = layer_seam_reference(r, attn, stream, layer=1, dims=dims, has_next=False, eps=eps)
  assert no_next[1] is None


# ------------------------------------------------------------- the kernel
@pytest.mark.parametrize("mp,has_next", [(16, True), (8, True), (64, True), (16, False)])
def test_kernel_lowers_to_one_mosaic_gpu_call_with_barriers_and_reduce_adds(mp, has_next):
  """At the 0.5B draft's shapes on 126 programs: one kernel, its residual,
  scratch and q/k/v buffers aliased in and out, TMA reduce-adds, and the
  grid barriers' GMEM semaphores zeroed before it."""
  dims = QWEN_05B
  s = jax.ShapeDtypeStruct
  args = (s((mp, dims.a), jnp.bfloat16), s((3 * dims.blocks * 64, 128), jnp.bfloat16),
          s((mp, dims.d), jnp.float32), s((mp, dims.d), jnp.bfloat16), s((mp, 64), jnp.float32),
          s((mp, dims.nq), jnp.float32), s((), jnp.int32))
  fn = functools.partial(layer_seam_gpu, dims=dims, has_next=has_next, eps=1e-6,
                         programs=programs_needed(dims))
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
  assert "output_operand_alias" in text and "cp.reduce.async.bulk.tensor" in text
  assert programs_needed(dims) == 126 and fits(dims, mp)


def test_fits_and_the_entry_points_checks():
  assert fits(QWEN_05B, 16) and fits(QWEN_05B, 64)
  assert not fits(QWEN_05B, 12) and not fits(QWEN_05B, 72)
  # Llama-3.2-1B: 128 MLP programs + 32 o owners do not fit 132 SMs
  assert not fits(SeamDims(d=2048, a=2048, f=8192, nq=3072), 16)
  dims = SeamDims(d=256, a=128, f=192, nq=256)
  stream = jnp.concatenate([seam_layout(*ws) for ws in weights(3, dims, 2)])
  r, attn = activations(4, dims, 8, 8)
  bufs = (jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((8, 64)), jnp.zeros((8, 256)))
  with pytest.raises(ValueError, match="attn"):
    layer_seam(r, attn[:, :64], stream, *bufs, 0, dims=dims, has_next=True, eps=1e-6)
  with pytest.raises(ValueError, match="stream"):  # layer 1 has no next layer in the stream
    layer_seam(r, attn, stream, *bufs, 1, dims=dims, has_next=True, eps=1e-6)
  with pytest.raises(ValueError, match="xb"):
    layer_seam(r, attn, stream, bufs[0][:4], *bufs[1:], 0, dims=dims, has_next=True, eps=1e-6)
  with pytest.raises(ValueError, match="multiples"):
    layer_seam(r, attn, stream, *bufs, 0, dims=SeamDims(d=192, a=128, f=192, nq=256),
               has_next=True, eps=1e-6)
  got = layer_seam(r, attn, stream, *bufs, 0, dims=dims, has_next=True, eps=1e-6,
                   impl="reference")
  want = layer_seam_reference(r, attn, stream, layer=0, dims=dims, has_next=True, eps=1e-6)
  np.testing.assert_array_equal(as_f32(got[0]), as_f32(want[0]))
  np.testing.assert_array_equal(as_f32(got[3]), as_f32(want[1]))
  assert not np.any(as_f32(got[2]))


@pytest.mark.skipif(not ON_HOPPER, reason="the kernel compiles for Hopper GPUs only")
@pytest.mark.parametrize("m,mp", [(16, 16), (5, 8), (32, 32), (16, 32), (64, 64)])
def test_kernel_compiled_equals_reference_over_a_chain_of_layers(m, mp):
  """Three layers in a row at the 0.5B's shapes, the buffers threaded from
  call to call as the decoder does (ss must come back zero, q/k/v is zeroed
  by the kernel itself): each call's residual and q/k/v equal the
  reference's from the same inputs."""
  dims = QWEN_05B
  layers = 3
  stream = jnp.concatenate([seam_layout(*ws) for ws in weights(5, dims, layers)])
  r, _ = activations(6, dims, m, mp)
  xb = jnp.zeros((mp, dims.d), jnp.bfloat16)
  ss = jnp.zeros((mp, 64), jnp.float32)
  qkv = jnp.full((mp, dims.nq), 7.0, jnp.float32)  # garbage the kernel must zero first
  for layer in range(layers):
    _, attn = activations(10 + layer, dims, m, mp)
    has_next = layer + 1 < layers
    want_r, want_qkv = layer_seam_reference(r, attn, stream, layer=layer, dims=dims,
                                            has_next=has_next, eps=1e-6)
    r, xb, ss, qkv = layer_seam(r, attn, stream, xb, ss, qkv, layer, dims=dims,
                                has_next=has_next, eps=1e-6, impl="gpu")
    # the kernel sums in its own order; bf16 roundings of h and of the q/k/v input may flip
    np.testing.assert_allclose(as_f32(r)[:m], as_f32(want_r)[:m], rtol=2e-2, atol=2e-2)
    if has_next:
      assert not np.any(as_f32(ss)), "ss must be zero again for the next call"
      np.testing.assert_allclose(as_f32(qkv)[:m], as_f32(want_qkv)[:m], rtol=3e-2, atol=3e-2)
    r = want_r  # the next layer from the reference's input, so errors do not compound


# ----------------------------------------------------- the decoder, fused
def _tiny_decoder(seed=3, head_dim=32):
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.models.decoder import Decoder
  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=128, intermediate_size=192,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                    rope=RopeConfig(theta=1e6), qkv_bias=True, dtype="bfloat16")
  nq = (cfg.num_heads + 2 * cfg.num_kv_heads) * head_dim
  model = Decoder(cfg, rngs=nnx.Rngs(seed))
  for layer in model.layers:  # non-trivial norm weights and biases, so a missed one shows
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
      norm.weight = nnx.Param(norm.weight[...] * (1 + 0.3 * jnp.cos(jnp.arange(128.0))))
    layer.self_attn.qkv_proj.bias = nnx.Param(0.1 * jnp.sin(jnp.arange(nq * 1.0)).astype(jnp.bfloat16))
  model.fold_norm_weights()
  return cfg, model


# the pass's attention: the Triton kernel (head_dim 32), the Mosaic one (64);
# the seam's rows padded to a multiple of 8 or of 32
@pytest.mark.parametrize("attention,head_dim,seam_rows", [("triton", 32, 8), ("triton", 32, 32),
                                                          ("mosaic", 64, 8)])
def test_decoder_with_fused_seams_equals_the_decoder_on_a_streaming_window(attention, head_dim,
                                                                          seam_rows):
  """`Decoder.fuse_seams` keeps a streaming draft's forward (its kernels on a
  Hopper GPU, the references elsewhere), the cache rows written and the
  tapped queries included; blocks of more than 64 rows run the layers."""
  from dustin_jax.cache import KVCache
  cfg, model = _tiny_decoder(head_dim=head_dim)
  fused = _tiny_decoder(head_dim=head_dim)[1]
  fused.fuse_seams(attention=attention)
  fused.seam_rows = seam_rows
  assert fused.window_kernel == attention
  assert fused.seam_stream.shape == (2 * fused.seam_dims().blocks * 64, 128)
  cache = KVCache.init(cfg, batch=4, max_len=96)
  prompt = jax.random.randint(jax.random.key(0), (4, 40), 0, 101)
  _, cache, _ = model(prompt, cache)
  cache = cache.with_lengths(jnp.full((4,), 40, jnp.int32))
  window = (4, 16)
  for t in (1, 3, 17):  # 4, 12 (padded to 16) and 68 (> 64: the layers) rows
    tokens = jax.random.randint(jax.random.key(t), (4, t), 0, 101)
    want, want_cache, want_taps = model(tokens, cache, window=window, tap_layers=(1,))
    got, got_cache, got_taps = fused(tokens, cache, window=window, tap_layers=(1,))
    # bf16 activations: the fused pass keeps the residual in f32 and rounds elsewhere
    np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(as_f32(got_taps[1]), as_f32(want_taps[1]), rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(as_f32(got_cache.k[1][:, :, 40:40 + t]),
                               as_f32(want_cache.k[1][:, :, 40:40 + t]), rtol=5e-2, atol=5e-2)


def test_fuse_seams_needs_folded_norms():
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.models.decoder import Decoder
  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=128, intermediate_size=192,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                    rope=RopeConfig(theta=1e6), dtype="bfloat16")
  with pytest.raises(ValueError, match="fold_norm_weights"):
    Decoder(cfg, rngs=nnx.Rngs(0)).fuse_seams()
  with pytest.raises(ValueError, match="'triton' or 'mosaic'"):
    Decoder(cfg, rngs=nnx.Rngs(0)).fuse_seams(attention="cudnn")
