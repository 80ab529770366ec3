"""Pure-jnp reference of ``streamk_matmul`` and the kernel's work schedule.

Contract (``streamk_matmul_reference(x, w, acc)``): x [M, K] and w [K, N] of
one dtype (bf16 or f16), acc [M, N] of any float dtype. The result, in f32,
is ``acc + x @ w`` with the product accumulated in f32.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

TILE_K = 64    # K rows of a weight tile (one WGMMA's K)
TILE_N = 128   # N columns of a weight tile: an output tile


def streamk_matmul_reference(x: jax.Array, w: jax.Array, acc: jax.Array) -> jax.Array:
  return acc.astype(jnp.float32) + jnp.dot(x, w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The product's units (output tile n, K step k), numbered n-major
  (u = n * k_steps + k), split into `programs` contiguous runs whose lengths
  differ by at most one: program p runs units start(p) .. start(p) +
  count(p) - 1, adding its sum over each output tile it touches into that
  tile. So every program streams the same weight bytes, whatever the shape,
  and most output tiles are summed by two programs."""
  n_tiles: int
  k_steps: int
  programs: int

  @staticmethod
  def of(k: int, n: int, programs: int, tile_n: int = TILE_N) -> "Schedule":
    n_tiles, k_steps = n // tile_n, k // TILE_K
    return Schedule(n_tiles, k_steps, max(1, min(programs, n_tiles * k_steps)))

  @property
  def units(self) -> int:
    return self.n_tiles * self.k_steps

  @property
  def steps(self) -> int:
    """Pipeline steps of every program: the longest run."""
    return -(-self.units // self.programs)

  def start(self, p):
    base, extra = divmod(self.units, self.programs)
    return p * base + jnp.minimum(p, extra) if isinstance(p, jax.Array) else p * base + min(p, extra)

  def count(self, p):
    base, extra = divmod(self.units, self.programs)
    return base + (p < extra).astype(jnp.int32) if isinstance(p, jax.Array) else base + (p < extra)

  def tiles_of(self, p: int) -> range:
    """The output tiles program p adds into."""
    first = self.start(p) // self.k_steps
    last = (self.start(p) + self.count(p) - 1) // self.k_steps
    return range(first, last + 1)
