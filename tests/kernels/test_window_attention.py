"""window_attention: the reference vs the model's composition (RoPE, cache
write, sparse_verify over the sink + window indices); the Pallas GPU kernel
(interpret mode on CPU) vs the reference.  The kernels take q, k_new, v_new
packed as qkv [B, T, Hkv, G + 2, D]; the composition takes them apart."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels.window_attention import ops
from kernels.window_attention.reference import window_attention_reference
from kernel_cases import (ON_GPU, assert_compiled_close, assert_written,
                          check_caches, make_case, pack, packed, rel_err)


def test_pack_is_the_fused_projection_layout():
  # pack's qkv flattened over (Hkv, G + 2, D) is [q | k | v] in the column
  # order of the model's qkv_proj, so its output reshapes to qkv for free
  from dustin_jax.models.decoder import qkv_columns
  B, T, Hq, Hkv, D = 2, 3, 14, 2, 8
  q, k_new, v_new = (jax.random.normal(jax.random.PRNGKey(i), (B, T, h, D))
                     for i, h in enumerate((Hq, Hkv, Hkv)))
  flat = jnp.concatenate([x.reshape(B, T, -1) for x in (q, k_new, v_new)], -1)
  np.testing.assert_array_equal(
      pack(q, k_new, v_new).reshape(B, T, -1),
      flat[..., qkv_columns(Hq, Hkv, D)])


def composition(q, k_new, v_new, k_cache, v_cache, L, cos, sin, n_sink,
                n_window):
  """What the model does today, op by op."""
  from dustin_jax.cache import write_rows
  from dustin_jax.models.decoder import apply_rope
  from dustin_jax.selection.base import sink_window_indices
  from kernels.sparse_verify.reference import sparse_verify_reference
  c2 = jnp.concatenate([cos, cos], -1)
  s2 = jnp.concatenate([sin, sin], -1)
  qr, kr = apply_rope(q, c2, s2), apply_rope(k_new, c2, s2)
  kc = write_rows(k_cache, kr, L)
  vc = write_rows(v_cache, v_new, L)
  idx = sink_window_indices(L, n_sink, n_window)
  return sparse_verify_reference(qr, kc, vc, L, idx), kc, vc


# lengths for n_sink=4, n_window=16, S=64: L < n_sink, L == 0,
# n_sink <= L < n_sink + n_window, L == n_sink + n_window, L >> both.
LENGTHS = [[2, 11, 45], [0, 4, 20], [3, 19, 61]]


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_reference_equals_composition(T, lengths):
  D = 32 if T == 2 else 16
  args = make_case(0, 3, T, 4, 2, 64, D, lengths)
  out, kc, vc = window_attention_reference(*packed(args), n_sink=4,
                                           n_window=16)
  ref, kc_ref, vc_ref = composition(*args, 4, 16)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(kc, kc_ref)
  np.testing.assert_array_equal(vc, vc_ref)
  q, k_new, v_new, k_cache, v_cache, L, cos, sin = args
  from dustin_jax.models.decoder import apply_rope
  kr = apply_rope(k_new, jnp.concatenate([cos, cos], -1),
                  jnp.concatenate([sin, sin], -1))
  assert_written(kc, k_cache, kr, L)
  assert_written(vc, v_cache, v_new, L)
  assert np.isfinite(np.asarray(out)).all()


def test_reference_edge_budgets():
  # no sink, no window: each query sees the block only; sink only; window only
  args = make_case(1, 3, 2, 4, 2, 64, 16, [0, 7, 40])
  for n_sink, n_window in [(0, 0), (5, 0), (0, 9), (8, 8)]:
    out, kc, vc = window_attention_reference(*packed(args), n_sink=n_sink,
                                             n_window=n_window)
    ref, kc_ref, _ = composition(*args, n_sink, n_window)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kc, kc_ref)


def test_reference_bf16_equals_composition():
  args = make_case(2, 3, 2, 8, 2, 64, 32, [2, 11, 45], jnp.bfloat16)
  out, kc, vc = window_attention_reference(*packed(args), n_sink=4,
                                           n_window=16)
  ref, kc_ref, vc_ref = composition(*args, 4, 16)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, ref) < 1e-6
  np.testing.assert_array_equal(np.asarray(kc, np.float32),
                                np.asarray(kc_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(vc, np.float32),
                                np.asarray(vc_ref, np.float32))


def test_auto_dispatch_and_errors():
  """"auto" runs the reference off GPU (bit-equal) and the kernel on GPU
  (equal to rounding)."""
  args = make_case(3, 2, 1, 4, 2, 32, 16, [5, 9])
  got = ops.window_attention(*packed(args), n_sink=2, n_window=4)
  want = window_attention_reference(*packed(args), n_sink=2, n_window=4)
  for a, b in zip(got, want):
    if ON_GPU:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(a, b)
  qkv, k_cache, v_cache, L, cos, sin = packed(args)
  with pytest.raises(ValueError, match="cos, sin"):
    ops.window_attention(qkv, k_cache, v_cache, L, cos[..., :4], sin,
                         n_sink=2, n_window=4, impl="reference")
  with pytest.raises(ValueError, match="dtype"):
    ops.window_attention(qkv, k_cache.astype(jnp.bfloat16), v_cache, L, cos,
                         sin, n_sink=2, n_window=4)
  odd = make_case(3, 2, 1, 4, 2, 32, 24, [5, 9])
  with pytest.raises(ValueError, match="power of two"):
    ops.window_attention(*packed(odd), n_sink=2, n_window=4, impl="gpu",
                         interpret=True)


@pytest.mark.parametrize("impl", ["reference", "gpu"])
def test_wrongly_packed_qkv_raises(impl):
  """qkv must be 5-D with the caches' Hkv on axis 2 and G + 2 >= 3 slots on
  axis 3; the unpacked q, or qkv packed for another Hkv, is refused."""
  q, k_new, v_new, k_cache, v_cache, L, cos, sin = make_case(
      3, 2, 1, 4, 2, 32, 16, [5, 9])
  rest = (k_cache, v_cache, L, cos, sin)
  kw = dict(n_sink=2, n_window=4, impl=impl, interpret=True)
  layout = r"qkv must be \[B, T, Hkv, G \+ 2, D\]"
  # Hq = 4 packed for Hkv = 1 ([.., 1, 6, D]) against caches of Hkv = 2
  with pytest.raises(ValueError, match=layout):
    ops.window_attention(pack(q, k_new[:, :, :1], v_new[:, :, :1]), *rest,
                         **kw)
  # G = 0: k and v only
  with pytest.raises(ValueError, match=r"Hkv=2 and G = Hq // Hkv >= 1"):
    ops.window_attention(jnp.stack([k_new, v_new], axis=3), *rest, **kw)
  # the unpacked q
  with pytest.raises(ValueError, match=layout):
    ops.window_attention(q, *rest, **kw)


# (T, Hq, Hkv, D, lengths, n_sink, n_window, dtype, tuning)
GPU_CASES = [
    (1, 4, 2, 16, [2, 11, 45], 4, 16, jnp.float32, {}),
    (2, 4, 2, 32, [0, 4, 20], 4, 16, jnp.float32, {}),
    (2, 4, 2, 32, [3, 19, 61], 4, 16, jnp.bfloat16, {}),
    # G = 7, T = 3 (21 rows -> M = 32); n_sink not a power of two; a window
    # of 40 rows in tiles of 16 (the last one partial)
    (3, 14, 2, 16, [1, 30, 58], 5, 40, jnp.float32, dict(block_w=16)),
    # sink only / window only
    (2, 4, 2, 16, [2, 11, 45], 6, 0, jnp.float32, {}),
    (2, 4, 1, 16, [2, 11, 45], 0, 24, jnp.bfloat16, dict(block_w=16)),
    # the window's tiles spread over programs, merged after: one tile each
    # (a program whose tile the window does not reach: L = 2, 11), and two
    # programs walking three tiles
    (2, 4, 2, 32, [2, 11, 45], 4, 48, jnp.float32, dict(block_w=16, splits=3)),
    (3, 14, 2, 16, [1, 30, 58], 5, 40, jnp.bfloat16, dict(block_w=16, splits=2)),
    (1, 4, 2, 16, [0, 4, 20], 0, 32, jnp.float32, dict(block_w=16, splits=2)),
    # each tile's loads issued after the previous tile's math
    (3, 14, 2, 16, [1, 30, 58], 5, 40, jnp.float32,
     dict(block_w=16, prefetch=False)),
    (2, 4, 2, 32, [2, 11, 45], 4, 48, jnp.bfloat16,
     dict(block_w=16, splits=2, prefetch=False)),
    # every tile of a program loaded before its math (tiles the window does
    # not reach at L = 2, 11: masked); one program, and two programs of
    # two tiles each
    (3, 14, 2, 16, [1, 30, 58], 5, 40, jnp.float32, dict(block_w=16, unroll=True)),
    (2, 4, 2, 32, [2, 11, 45], 4, 48, jnp.bfloat16,
     dict(block_w=16, splits=2, unroll=True)),
]


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_kernel_interpret(case):
  T, Hq, Hkv, D, lengths, n_sink, n_window, dtype, tuning = case
  args = make_case(4, 3, T, Hq, Hkv, 64, D, lengths, dtype)
  out, kc, vc = ops.window_attention(*packed(args), n_sink=n_sink,
                                     n_window=n_window, impl="gpu",
                                     interpret=True, **tuning)
  ref, kc_ref, vc_ref = window_attention_reference(
      *packed(args), n_sink=n_sink, n_window=n_window)
  assert out.shape == args[0].shape and out.dtype == dtype
  assert kc.dtype == dtype and vc.dtype == dtype
  assert rel_err(out, ref) < (1e-5 if dtype == jnp.float32 else 2e-2)
  check_caches(kc, vc, kc_ref, vc_ref, args, exact_k=dtype == jnp.bfloat16)


def test_gpu_kernel_interpret_default_caps_programs_per_head():
  # A window of more 128-row tiles than MAX_SPLITS: with the default
  # tuning each program walks several tiles (L = 2200: 16 tiles over 8
  # programs; L = 1000: 8 tiles, one each; L = 300: programs with none).
  from kernels.window_attention.gpu import MAX_SPLITS, default_tuning
  n_window = 2032
  tuning = default_tuning(n_window)
  assert tuning["splits"] == MAX_SPLITS
  assert tuning["splits"] * tuning["block_w"] < n_window
  args = make_case(7, 3, 1, 4, 1, 2304, 16, [2200, 1000, 300])
  out, kc, vc = ops.window_attention(*packed(args), n_sink=16,
                                     n_window=n_window, impl="gpu",
                                     interpret=True)
  ref, kc_ref, vc_ref = window_attention_reference(
      *packed(args), n_sink=16, n_window=n_window)
  assert rel_err(out, ref) < 1e-5
  check_caches(kc, vc, kc_ref, vc_ref, args, exact_k=False)


def test_gpu_kernel_interpret_under_jit_donated():
  # Traced lengths; the caches donated (aliased outputs may reuse them).
  args = make_case(5, 3, 2, 4, 2, 64, 16, [2, 11, 45])
  ref = window_attention_reference(*packed(args), n_sink=4, n_window=16)
  f = jax.jit(lambda *a: ops.window_attention(*a, n_sink=4, n_window=16,
                                              impl="gpu", interpret=True),
              donate_argnums=(1, 2))
  qkv, k_cache, v_cache = packed(args)[:3]
  out, kc, vc = f(qkv, k_cache + 0, v_cache + 0, *args[5:])
  assert rel_err(out, ref[0]) < 1e-5
  check_caches(kc, vc, ref[1], ref[2], args, exact_k=False)


# ---------------------------------------------------------------- real GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@gpu_only
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("Hq,Hkv", [(14, 2), (32, 8)])
@pytest.mark.parametrize("splits", [1, None])  # one program per head; the default
@pytest.mark.parametrize("n_window", [496, 2032])  # SpecConfig's default: 2032
def test_gpu_kernel_compiled_draft_shapes(T, Hq, Hkv, splits, n_window):
  # the draft models' layer shapes, 16 sink rows
  args = make_case(6, 4, T, Hq, Hkv, 4096, 64, [4000, 5, 300, 2100],
                   jnp.bfloat16)
  got = ops.window_attention(*packed(args), n_sink=16, n_window=n_window,
                             splits=splits)
  assert_compiled_close(got, window_attention_reference(
      *packed(args), n_sink=16, n_window=n_window))


@gpu_only
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("tuning", [dict(unroll=True), dict(unroll=True, splits=4),
                                    dict(unroll=True, block_w=64, num_warps=8)])
def test_gpu_kernel_compiled_unrolled(T, tuning):
  # the 0.5B draft's shapes at the default window, every tile of a program
  # loaded before its math
  args = make_case(6, 4, T, 14, 2, 4096, 64, [4000, 5, 300, 2100], jnp.bfloat16)
  got = ops.window_attention(*packed(args), n_sink=16, n_window=2032, **tuning)
  assert_compiled_close(got, window_attention_reference(
      *packed(args), n_sink=16, n_window=2032))
