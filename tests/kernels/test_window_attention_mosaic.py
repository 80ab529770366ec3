"""window_attention_rows and its Mosaic GPU kernel (`mosaic_gpu`): the
packing of its inputs, its tiling arithmetic (an emulation in jnp: the
window tiles from a row a multiple of 8, 64-row block and sink tiles, V rows
outside the window zeroed, the guarded online softmax, the merge of split
programs) against the reference, its lowering for CUDA, its argument
checks, and (on a Hopper GPU) the compiled kernel against the reference.
jax 0.10.2's interpret mode cannot run it (no transposed WGMMA operand)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels import common
from kernels.window_attention import mosaic_gpu, ops
from kernels.window_attention.reference import window_attention_reference
from kernel_cases import assert_compiled_close, make_case, packed, rel_err


def rows_of(out):
  """[B, T, Hq, D] -> the token rows [B * T, Hq * D]."""
  b, t, hq, d = out.shape
  return out.reshape(b * t, hq * d)


def tiled_emulation(blocks, k_cache, v_cache, lengths, *, g, t, n_sink, n_window, splits):
  """The kernel's arithmetic in jnp, tile by tile and program by program
  (f32 logits, p rounded to the inputs' dtype before p v)."""
  rows_b, new = mosaic_gpu.BLOCK_ROWS, mosaic_gpu.NEW_ROWS
  nb, hkv, qr, d = blocks.shape
  qr -= 2 * new
  # a 64-row tile holds the rows loaded, then stale shared memory (NaN here)
  stale = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, rows_b - x.shape[2]),  # noqa: E731
                                                    (0, 0)), constant_values=jnp.nan)
  q, k_new, v_new = blocks[:, :, :qr], stale(blocks[:, :, qr:qr + new]), stale(blocks[:, :, qr + new:])
  ns = common.round_up(n_sink, 8)
  tiles = mosaic_gpu.window_tiles(n_window)
  mine = common.cdiv(tiles, splits)
  s_len = k_cache.shape[2]
  scale = common.LOG2E / d ** 0.5
  f32 = jnp.float32

  def update(carry, s, v, live_rows):
    o, m, l = carry
    v = jnp.where(live_rows[:, None], v, 0.0)  # stale rows may be NaN
    m_new = jnp.maximum(m, s.max(1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    return (o * alpha[:, None] + p.astype(q.dtype).astype(f32) @ v, m_new,
            l * alpha + p.sum(1))

  def rows(cache, b, h, start, n, loaded=None):  # a TMA box: rows past S read as zeros
    r = start + jnp.arange(n)
    got = jnp.take(cache[b, h], jnp.clip(r, 0, s_len - 1), axis=0).astype(f32)
    got = jnp.where((r < s_len)[:, None], got, 0.0)
    return got if loaded is None else jnp.where((r < start + loaded)[:, None], got, jnp.nan)

  out = jnp.zeros((nb * t, g * hkv * d), q.dtype)
  for b in range(nb):
    length = lengths[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8
    for h in range(hkv):
      qb = q[b, h].astype(f32)
      r = jnp.arange(qr)
      parts = []
      for p in range(splits):
        carry = (jnp.zeros((qr, d), f32), jnp.full((qr,), -jnp.inf, f32), jnp.zeros((qr,), f32))
        if p == 0:
          j = jnp.arange(rows_b)
          s = jnp.where(j[None] <= (r % t)[:, None], qb @ k_new[b, h].astype(f32).T * scale,
                        -jnp.inf)
          carry = update(carry, s, v_new[b, h].astype(f32), j < t)
          if n_sink:
            live = j < jnp.minimum(length, n_sink)
            s = jnp.where(live[None], qb @ rows(k_cache, b, h, 0, rows_b, ns).T * scale, -jnp.inf)
            carry = update(carry, s, rows(v_cache, b, h, 0, rows_b, ns), live)
        for i in range(mine):
          tile = p + i * splits
          start = w0a + tile * mosaic_gpu.WINDOW_TILE
          pos = start + jnp.arange(mosaic_gpu.WINDOW_TILE)
          live = (pos >= w0) & (pos < length) & (tile < tiles)
          s = jnp.where(live[None], qb @ rows(k_cache, b, h, start, len(pos)).T * scale, -jnp.inf)
          carry = update(carry, s, rows(v_cache, b, h, start, len(pos)), live)
        parts.append(carry)
      o, m, l = parts[0]
      for o_j, m_j, l_j in parts[1:]:
        m_new = jnp.maximum(m, m_j)
        a, c = jnp.exp2(m - m_new), jnp.exp2(m_j - m_new)
        o, l, m = o * a[:, None] + o_j * c[:, None], l * a + l_j * c, m_new
      o = (o / l[:, None])[:g * t].reshape(g, t, d).astype(q.dtype)
      for gi in range(g):
        out = out.at[b * t:(b + 1) * t, (h * g + gi) * d:(h * g + gi + 1) * d].set(o[gi])
  return out


def test_pack_window_inputs_orders_queries_per_kv_head_and_pads_the_block():
  T, Hq, Hkv, D = 2, 6, 2, 64
  args = make_case(0, 2, T, Hq, Hkv, 32, D, [3, 7], jnp.bfloat16)
  q, k_new, v_new, _, _, _, cos, sin = args
  blocks = mosaic_gpu.pack_window_inputs(packed(args)[0], cos, sin)
  g, new = Hq // Hkv, mosaic_gpu.NEW_ROWS
  assert blocks.shape == (2, Hkv, 8 + 2 * new, D)  # q rows (6 -> 8), k rows, v rows
  q_roped = common.rope(q, cos, sin)  # [B, T, Hq, D]
  k_roped = common.rope(k_new, cos, sin)
  for h in range(Hkv):
    for gi in range(g):
      for t in range(T):
        np.testing.assert_array_equal(blocks[:, h, gi * T + t], q_roped[:, t, h * g + gi])
    np.testing.assert_array_equal(blocks[:, h, 8:8 + T], k_roped[:, :, h])
    np.testing.assert_array_equal(blocks[:, h, 8 + new:8 + new + T], v_new[:, :, h])
  zero_rows = np.r_[g * T:8, 8 + T:8 + new, 8 + new + T:8 + 2 * new]
  assert not np.any(np.asarray(blocks[:, :, zero_rows], np.float32))


# contexts of S = 300 rows with 4 sink + 160 window rows (2 tiles): shorter
# than the sink, inside the window, a window that starts off a multiple of 8,
# one whose tiles run past S; the caches hold NaN past lengths + T
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_kernels_tiling_arithmetic_equals_the_reference(T, splits):
  args = make_case(1, 4, T, 4, 2, 300, 64, [2, 100, 203, 297], jnp.bfloat16)
  want, _, _ = ops.window_attention_rows(*packed(args), n_sink=4, n_window=160,
                                         impl="reference")
  blocks = mosaic_gpu.pack_window_inputs(packed(args)[0], *args[6:])
  got = tiled_emulation(blocks, args[3], args[4], args[5], g=2, t=T, n_sink=4,
                        n_window=160, splits=splits)
  assert got.shape == want.shape == (4 * T, 4 * 64)
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  assert rel_err(got, want) < 2e-2


def test_rows_entry_is_window_attention_as_token_rows():
  args = make_case(2, 3, 2, 4, 2, 64, 16, [2, 11, 45])
  out, kc, vc = ops.window_attention(*packed(args), n_sink=4, n_window=16, impl="reference")
  rows, kc_rows, vc_rows = ops.window_attention_rows(*packed(args), n_sink=4, n_window=16,
                                                     impl="reference")
  np.testing.assert_array_equal(rows[3 * 2 - 1, 3 * 16:4 * 16], out[2, 1, 3])  # b 2, t 1, head 3
  np.testing.assert_array_equal(rows, rows_of(out))
  np.testing.assert_array_equal(kc_rows, kc)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("t", [1, 2])
def test_kernel_lowers_to_one_mosaic_gpu_call_with_the_caches_aliased(t, splits):
  # the 0.5B draft's attention: 16 sequences, 2 KV heads of 7 queries, D 64
  qkv = jax.ShapeDtypeStruct((16, t, 2, 9, 64), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((16, 2, 4096, 64), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((16,), jnp.int32)
  table = jax.ShapeDtypeStruct((16, t, 32), jnp.float32)
  f = jax.jit(lambda *a: ops.window_attention_rows(*a, n_sink=16, n_window=496, impl="mosaic",
                                                   splits=splits))
  text = f.trace(qkv, cache, cache, lengths, table, table).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1 and text.count("window_attention_rows") >= 1
  assert "output_operand_aliases" in text


def test_mosaic_entry_checks_its_shapes():
  def call(T=1, Hq=4, D=64, dtype=jnp.bfloat16, splits=None, n_sink=4, n_window=160):
    args = make_case(3, 2, T, Hq, 2, 64, D, [5, 9], dtype)
    return ops.window_attention_rows(*packed(args), n_sink=n_sink, n_window=n_window,
                                     impl="mosaic", splits=splits)
  with pytest.raises(ValueError, match="head_dim 64"):
    call(D=32)
  with pytest.raises(ValueError, match="T <= 8"):
    call(T=9)
  with pytest.raises(ValueError, match="bf16 / f16"):
    call(dtype=jnp.float32)
  with pytest.raises(ValueError, match="splits must be in"):
    call(splits=3)
  with pytest.raises(ValueError, match="n_sink must be in"):
    call(n_sink=65)
  assert mosaic_gpu.fits(16, 1, 2, 7, 64, jnp.bfloat16, 16, 496, 32768)
  assert not mosaic_gpu.fits(16, 1, 2, 7, 64, jnp.bfloat16, 16, 496, 33366)
  assert not mosaic_gpu.fits(16, 1, 2, 7, 128, jnp.bfloat16, 16, 496, 32768)
  assert not mosaic_gpu.fits(16, 10, 2, 7, 64, jnp.bfloat16, 16, 496, 32768)


def test_default_splits_one_tile_a_program_while_the_programs_fit_the_sms():
  assert mosaic_gpu.default_splits(16, 2, 496, sms=132) == 4  # 128 programs
  assert mosaic_gpu.default_splits(32, 2, 496, sms=132) == 1
  assert mosaic_gpu.window_tiles(496) == 4 and mosaic_gpu.window_tiles(121) == 1
  with pytest.raises(ValueError, match="resident at once"):
    mosaic_gpu.check_args(jax.ShapeDtypeStruct((32, 1, 2, 9, 64), jnp.bfloat16),
                          jax.ShapeDtypeStruct((32, 2, 1024, 64), jnp.bfloat16), 16, 496, 4,
                          sms=132)


def test_splits_keep_each_programs_window_tiles_in_shared_memory():
  # one program holds at most 4 tiles (the 496-row window), a split one 3
  assert mosaic_gpu.program_fits(64, 496, 1) and not mosaic_gpu.program_fits(64, 632, 1)
  assert mosaic_gpu.program_fits(64, 2032, 6) and not mosaic_gpu.program_fits(64, 2032, 5)
  # 2032 rows: 17 tiles, 6 splits at least; 32 (b, h) x 6 exceed 132 SMs, 16 x 6 do not
  assert mosaic_gpu.default_splits(16, 2, 2032, sms=132) is None
  assert mosaic_gpu.default_splits(8, 2, 2032, sms=132) == 6
  assert not mosaic_gpu.fits(16, 1, 2, 7, 64, jnp.bfloat16, 16, 2032, 32768)
  with pytest.raises(ValueError, match="do not fit shared memory"):
    mosaic_gpu.check_args(jax.ShapeDtypeStruct((1, 1, 2, 9, 64), jnp.bfloat16),
                          jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.bfloat16), 16, 2032, 1)
  args = make_case(0, 16, 1, 14, 2, 4096, 64, [3000] * 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="no split count"):
    ops.window_attention_rows(*packed(args), n_sink=16, n_window=2032, impl="mosaic")


# ---------------------------------------------------------------- Hopper GPU
@pytest.mark.skipif(not common.is_hopper(), reason="needs a Hopper GPU (TMA, WGMMA)")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("splits", [1, None])  # one program per (b, h); the default
def test_kernel_compiled_equals_reference(T, splits):
  # the 0.5B draft's heads, the default 16 sink + 496 window rows; NaN past lengths + T
  args = make_case(6, 4, T, 14, 2, 2048, 64, [2000, 5, 300, 1000], jnp.bfloat16)
  got = ops.window_attention_rows(*packed(args), n_sink=16, n_window=496, impl="mosaic",
                                  splits=splits)
  out, kc, vc = window_attention_reference(*packed(args), n_sink=16, n_window=496)
  assert_compiled_close(got, (rows_of(out), kc, vc))


@pytest.mark.parametrize("max_len", [256, 250])
def test_seam_pass_with_the_mosaic_attention_lowers_to_two_kernels_a_layer(max_len):
  """A `draft_mlp="seam_mosaic"` draft's streaming pass, lowered for CUDA:
  per layer the attention kernel writes the rows the seam kernel reads (no
  Triton call, no merge), two Mosaic GPU calls a layer. Caches of a row
  count the Mosaic kernel refuses (not a multiple of 8) keep the Triton
  attention."""
  from flax import nnx
  from dustin_jax.cache import KVCache
  from dustin_jax.config import ModelConfig, RopeConfig
  from dustin_jax.models.decoder import Decoder
  cfg = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=128, intermediate_size=384,
                    num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64,
                    rope=RopeConfig(theta=1e6), qkv_bias=True, dtype="bfloat16")
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  model.fold_norm_weights()
  model.fuse_seams(attention="mosaic")
  graphdef, state = nnx.split(model)
  cache = KVCache.init(cfg, batch=4, max_len=max_len)

  def forward(state, tokens, cache):
    hidden, cache, _ = nnx.merge(graphdef, state)(tokens, cache, window=(4, 16), impl="gpu")
    return hidden, cache

  tokens = jax.ShapeDtypeStruct((4, 2), jnp.int32)
  text = jax.jit(forward).trace(state, tokens, cache).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"call @([\w.]+)\(", text)  # the jitted kernels' call sites
  assert len([c for c in calls if c.startswith("layer_seam_gpu")]) == cfg.num_layers
  if max_len % 8 == 0:
    assert calls.count("window_attention_rows_gpu") == cfg.num_layers
    assert "triton" not in text.lower()
  else:
    assert calls.count("window_attention_rows_gpu") == 0 and "triton" in text.lower()
