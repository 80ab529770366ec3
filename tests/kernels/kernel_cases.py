"""Inputs and error measure shared by the kernel tests."""
import numpy as np

import jax
import jax.numpy as jnp

ON_GPU = jax.default_backend() == "gpu"


def random_qkv(seed, B, T, Hq, Hkv, S, D, lengths, dtype=jnp.float32):
  """Random q [B, T, Hq, D] and k, v [B, Hkv, S, D] (never zeros), with NaN
  garbage in the cache rows past lengths + T: a kernel that reads a stale
  row shows it as a non-finite output."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, Hkv, S, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, Hkv, S, D), jnp.float32)
  lengths = jnp.asarray(lengths, jnp.int32)
  stale = jnp.arange(S)[None, None, :, None] >= (lengths + T)[:, None, None, None]
  k = jnp.where(stale, jnp.nan, k)
  v = jnp.where(stale, jnp.nan, v)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), lengths


def rel_err(out, ref):
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  assert np.isfinite(out).all(), "non-finite output (garbage leaked?)"
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# ------------------------------------------------ packed q/k/v with RoPE
def rope_half_tables(positions, D, theta=10000.0):
  """cos, sin [B, T, D // 2] f32 of integer positions [B, T]."""
  inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
  f = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
  return jnp.cos(f), jnp.sin(f)


def make_case(seed, B, T, Hq, Hkv, S, D, lengths, dtype=jnp.float32):
  """q, k_new, v_new (before RoPE), caches with NaN garbage past
  lengths + T (a stale read shows as a non-finite output), lengths, cos, sin
  of the positions lengths + t."""
  q, k_cache, v_cache, L = random_qkv(seed, B, T, Hq, Hkv, S, D, lengths)
  kk, kv = jax.random.split(jax.random.PRNGKey(seed + 1000))
  k_new = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32)
  v_new = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32)
  cos, sin = rope_half_tables(L[:, None] + jnp.arange(T)[None], D)
  cast = lambda x: x.astype(dtype)
  return (cast(q), cast(k_new), cast(v_new), cast(k_cache), cast(v_cache), L,
          cos, sin)


def pack(q, k_new, v_new):
  """qkv [B, T, Hkv, G + 2, D] of q [B, T, Hq, D], k_new, v_new [B, T, Hkv,
  D]: per KV head its G query heads, then k, then v."""
  B, T, Hq, D = q.shape
  Hkv = k_new.shape[2]
  return jnp.concatenate([q.reshape(B, T, Hkv, Hq // Hkv, D),
                          k_new[:, :, :, None], v_new[:, :, :, None]], axis=3)


def packed(args):
  """make_case's arguments with q, k_new, v_new packed into qkv."""
  return (pack(*args[:3]),) + tuple(args[3:])


def assert_written(kc, k_cache, rows_new, L, rtol=0.0):
  """kc holds rows_new [B, T, Hkv, D] at rows L .. L + T - 1 (to rtol, as
  much absolute) and k_cache's rows (NaN garbage included) everywhere else,
  bit-exact."""
  kc, k_cache = np.asarray(kc, np.float32), np.asarray(k_cache, np.float32)
  rows_new = np.asarray(rows_new, np.float32)
  T = rows_new.shape[1]
  for b, l in enumerate(np.asarray(L)):
    np.testing.assert_allclose(kc[b, :, l:l + T],
                               rows_new[b].transpose(1, 0, 2), rtol=rtol,
                               atol=rtol)
    np.testing.assert_array_equal(kc[b, :, :l], k_cache[b, :, :l])
    np.testing.assert_array_equal(kc[b, :, l + T:], k_cache[b, :, l + T:])


def check_caches(kc, vc, kc_ref, vc_ref, args, exact_k):
  """The kernel's caches vs the reference's: the v rows and every row outside
  the T written ones bit-exact; the roped k rows bit-exact in bf16 and to an
  f32 rounding in f32 (XLA and Triton may contract x * cos + rot * sin into
  an FMA, differently per compilation: jit vs eager reference differ alike)."""
  _, _, _, k_cache, v_cache, L, _, _ = args
  T = args[1].shape[1]
  kc_ref = np.asarray(kc_ref, np.float32)
  rows = np.stack([kc_ref[b, :, l:l + T] for b, l in enumerate(np.asarray(L))])
  assert_written(kc, k_cache, rows.transpose(0, 2, 1, 3), L,
                 rtol=0 if exact_k else 1e-6)
  np.testing.assert_array_equal(np.asarray(vc, np.float32),
                                np.asarray(vc_ref, np.float32))


def assert_compiled_close(got, want):
  """A compiled packed-q/k/v kernel's (out, k_cache, v_cache) against the
  reference's, bf16: out to its rounding, the roped k rows to 1e-2 (the
  compiled kernel may contract mul + add into an FMA), v bit-exact."""
  (out, kc, vc), (ref, kc_ref, vc_ref) = got, want
  assert rel_err(out, ref) < 2e-2
  np.testing.assert_allclose(np.asarray(kc, np.float32),
                             np.asarray(kc_ref, np.float32), rtol=1e-2,
                             atol=1e-2)
  np.testing.assert_array_equal(np.asarray(vc, np.float32),
                                np.asarray(vc_ref, np.float32))
