"""The seam between the speculative step and the selection policies.

A policy is a frozen (hashable, static) dataclass. The step calls its hooks
in the order of one speculative step (draft, select, verify); policy state
(`signals`) is a pytree carried in the step state from one step to the next:

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
from typing import Any, Protocol

import jax
import jax.numpy as jnp


class Policy(Protocol):
  """What the speculative step needs of a selection policy (all policies are
  frozen dataclasses: hashable, so the step compiles once per policy)."""
  name: str
  draft_tap_layers: tuple[int, ...]       # draft layers whose queries observe_draft reads
  target_tap_layers: tuple[int, ...]      # target layers whose queries observe_target reads
  full_verify_tap_layers: tuple[int, ...]  # non-empty: needs this step's full-cache verify pass

  @property
  def needs_full_verify(self) -> bool: ...
  def init(self, batch: int, max_len: int) -> Any: ...
  def observe_draft(self, signals, taps, draft_cache): ...
  def observe_full_verify(self, signals, taps, target_cache, gamma: int): ...
  def select(self, signals, target_cache, gamma: int) -> jax.Array | None: ...
  def observe_target(self, signals, taps, target_cache, gamma: int): ...


class PolicyDefaults:
  """No-op hooks: a policy overrides the ones it uses."""
  full_verify_tap_layers: tuple[int, ...] = ()

  @property
  def needs_full_verify(self) -> bool:
    """True when `select` ranks rows by this step's own verify queries
    (the oracle): the step then runs a full-cache target pass over the block
    first and calls `observe_full_verify`."""
    return bool(self.full_verify_tap_layers)

  def init(self, batch: int, max_len: int):
    return ()

  def observe_draft(self, signals, taps, draft_cache):
    return signals

  def observe_full_verify(self, signals, taps, target_cache, gamma):
    return signals

  def observe_target(self, signals, taps, target_cache, gamma):
    return signals


@dataclasses.dataclass(frozen=True)
class FullCache(PolicyDefaults):
  """Standard speculative decoding: verify against the whole cache."""

  name = "full"
  draft_tap_layers: tuple[int, ...] = ()
  target_tap_layers: tuple[int, ...] = ()

  def select(self, signals, target_cache, gamma):
    return None


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
