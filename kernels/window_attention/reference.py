"""Pure-jnp window attention with the new rows written: the oracle and the
fallback.

The q, k_new, v_new of the T new tokens come packed as qkv [B, T, Hkv,
G + 2, D] (``kernels.common.unpack_qkv``: the layout of the model's fused
q/k/v projection).  For sequence b with L = lengths[b] context rows already
in the cache:
  1. RoPE (rotate-half, f32, cast back to the input dtype) of q and k_new
     with the tables cos, sin of the T new positions;
  2. the roped k_new rows and the v_new rows are written into the caches at
     rows L .. L + T - 1 (rows at or past S are dropped, as
     ``dustin_jax.cache.write_rows`` does);
  3. query t (position L + t) attends, with GQA (query head h reads KV head
     h // (Hq // Hkv)), to the sink rows [0, min(n_sink, L)), the window rows
     [max(n_sink, L - n_window), L) and the block rows L .. L + t.  Softmax and
     accumulation in f32; output in q's dtype.
That is sparse_verify_packed over the sink and window rows
(``sink_window_indices``): only the n_sink + n_window + T candidate rows are
gathered, so the cost does not grow with the context.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.sparse_verify.reference import sparse_verify_packed_reference


def sink_window_indices(lengths: jax.Array, n_sink: int, n_window: int) -> jax.Array:
  """[B, n_sink + n_window] context rows: the first `n_sink` and the last
  `n_window` of `[0, lengths[b])`, each once, ascending; -1 marks the
  slots a short context leaves empty."""
  lengths = lengths.astype(jnp.int32)[:, None]
  sink = jnp.arange(n_sink, dtype=jnp.int32)[None]
  sink = jnp.where(sink < lengths, sink, -1)
  win = lengths - n_window + jnp.arange(n_window, dtype=jnp.int32)[None]
  # a window row that is also a sink row (short context) is dropped once
  win = jnp.where((win >= n_sink) & (win >= 0), win, -1)
  return jnp.concatenate([jnp.broadcast_to(sink, win.shape[:1] + sink.shape[1:]), win], axis=1)


def check_shapes(qkv, k_cache, v_cache, lengths, cos, sin, n_sink, n_window):
  """Validates the arguments; returns (B, T, Hq, D, Hkv, S)."""
  shapes = common.check_packed_shapes(qkv, k_cache, v_cache, lengths, cos, sin)
  if int(n_sink) < 0 or int(n_window) < 0:
    raise ValueError(f"n_sink={n_sink}, n_window={n_window} must be >= 0")
  return shapes


def window_attention_reference(qkv, k_cache, v_cache, lengths, cos, sin, *,
                               n_sink, n_window, scale=None):
  """Returns (out [B, T, Hq, D], k_cache, v_cache) with the rows written."""
  check_shapes(qkv, k_cache, v_cache, lengths, cos, sin, n_sink, n_window)
  indices = sink_window_indices(lengths, int(n_sink), int(n_window))
  return sparse_verify_packed_reference(qkv, k_cache, v_cache, lengths, indices,
                                        cos, sin, scale=scale)
