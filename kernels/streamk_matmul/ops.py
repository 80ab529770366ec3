"""Public entry point: ``acc + x @ w`` for a few rows, the weight streamed by
every SM in equal parts (see gpu.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.streamk_matmul.gpu import MAX_ROWS, default_stages, streamk_matmul_gpu
from kernels.streamk_matmul.reference import TILE_K, TILE_N, streamk_matmul_reference

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def sm_count() -> int:
  """Streaming multiprocessors of the first device (132 on an H100 / H200)."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def fits(m: int, k: int, n: int, dtype) -> bool:
  """Whether the kernel takes x [m, k] @ w [k, n] (rows, tile multiples, dtype)."""
  return (1 <= m <= MAX_ROWS and k % TILE_K == 0 and n % TILE_N == 0
          and jnp.dtype(dtype) in DTYPES)


def streamk_matmul(x, w, acc, *, impl: str = "auto", programs: int | None = None,
                   stages: int | None = None, out_slots: int = 2,
                   interpret: bool = False) -> jax.Array:
  """``acc + x @ w`` in f32 for x [M, K], w [K, N], acc [M, N].

  impl: "auto" (the Mosaic GPU kernel on a Hopper GPU when it `fits`, else
  the reference), "gpu" (Hopper: TMA, WGMMA) or "reference". programs: the
  runs the work is split into (default: one per SM); stages: weight tiles
  in flight (default: as many as fit, at most 6); out_slots: the f32
  shared-memory slots the output tiles are stored through.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"x must be [M, K] and w [K, N], got {x.shape} and {w.shape}")
  m, k = x.shape
  n = w.shape[1]
  if acc.shape != (m, n):
    raise ValueError(f"acc must be [M, N] = {(m, n)}, got {acc.shape}")
  if x.dtype != w.dtype:
    raise ValueError(f"x and w must have one dtype, got {x.dtype} and {w.dtype}")
  if impl == "auto":
    impl = "gpu" if common.is_hopper() and fits(m, k, n, x.dtype) else "reference"
  impl = common.resolve_impl(impl)
  if impl != "gpu":
    return streamk_matmul_reference(x, w, acc)
  if not fits(m, k, n, x.dtype):
    raise ValueError(f"the kernel takes 1..{MAX_ROWS} rows of bf16 or f16, K a multiple of "
                     f"{TILE_K} and N of {TILE_N}; got x {x.shape} {x.dtype}, w {w.shape}")
  rows = common.round_up(m, 8)  # TMA stores rows in tiles of 8
  if stages is None:
    stages = default_stages(rows, x.dtype.itemsize)
  pad = ((0, rows - m), (0, 0))
  out = streamk_matmul_gpu(jnp.pad(x, pad), w, jnp.pad(acc, pad),
                           programs=programs or sm_count(), stages=stages, out_slots=out_slots,
                           interpret=interpret)
  return out[:m]
