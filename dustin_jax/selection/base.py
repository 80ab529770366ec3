"""The seam between the speculative step and the selection policies.

A policy is a frozen (hashable, static) dataclass. The step calls its hooks
in METHOD.md's order; policy state (`signals`) is a pytree carried in the
step state from one step to the next:

  signals = policy.init(batch, max_len)
  after drafting:     signals = policy.observe_draft(signals, taps, draft_cache)
  kv_indices          = policy.select(signals, target_cache, gamma)   # None: full cache
  after verify:       signals = policy.observe_target(signals, taps, target_cache, gamma)

`taps` maps a layer index to that layer's queries [B, T, Hq, D] (query t at
position `cache.lengths[b] + t`; for the draft, the gamma lookahead queries
predicting d_1 .. d_gamma, with every key they see already written); a policy
names the layers it needs in `draft_tap_layers` / `target_tap_layers`, and
the models return only those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class FullCache:
  """Standard speculative decoding: verify against the whole cache."""

  name = "full"
  draft_tap_layers: tuple[int, ...] = ()
  target_tap_layers: tuple[int, ...] = ()

  def init(self, batch: int, max_len: int):
    return ()

  def observe_draft(self, signals, taps, draft_cache):
    return signals

  def select(self, signals, target_cache, gamma):
    return None

  def observe_target(self, signals, taps, target_cache, gamma):
    return signals


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
