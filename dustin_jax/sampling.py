"""The one sampling routine: logits -> a filtered distribution -> tokens.

Speculative acceptance applies exactly the same `probs()` to draft and
target logits, so the rejection sampler preserves the distribution a plain
sampler with these settings would draw from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 means greedy; top_k 0 and top_p 1 mean no filtering."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """f32 probabilities over the last axis after temperature, top-k, top-p.
  Greedy: a one-hot of the argmax (`next_tokens` and greedy acceptance
  need no distribution and skip it)."""
  logits = logits.astype(jnp.float32)
  if cfg.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits / cfg.temperature
  if cfg.top_k:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if cfg.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    sorted_p = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep = mass_before < cfg.top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.nn.softmax(logits, axis=-1)


def sample(rng: jax.Array, p: jax.Array) -> jax.Array:
  """Draw one token id per row of probabilities `p[..., V]` (int32)."""
  logp = jnp.log(jnp.maximum(p, 0.0))
  return jax.random.categorical(rng, logp, axis=-1).astype(jnp.int32)


def next_tokens(rng: jax.Array, logits: jax.Array, cfg: SamplingConfig):
  """The next token of each row of `logits[..., V]` (int32) and the
  distribution it was drawn from: greedy takes the argmax and forms no
  distribution (None: greedy acceptance compares tokens), otherwise a draw
  from `probs()`."""
  if cfg.greedy:
    return jnp.argmax(logits.astype(jnp.float32), -1).astype(jnp.int32), None
  p = probs(logits, cfg)
  return sample(rng, p), p


def pad_vocab(x: jax.Array, size: int) -> jax.Array:
  """Pad the last axis of logits to `size` with -inf (draft and target may
  differ in padded vocabulary size)."""
  extra = size - x.shape[-1]
  if extra == 0:
    return x
  pad = jnp.full(x.shape[:-1] + (extra,), -jnp.inf, x.dtype)
  return jnp.concatenate([x, pad], axis=-1)
