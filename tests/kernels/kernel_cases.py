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
