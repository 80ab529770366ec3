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

# the rows a streaming window attends to: the one definition the policies
# and the window_attention kernel share
from kernels.window_attention.reference import sink_window_indices  # noqa: F401


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
