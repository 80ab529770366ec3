"""Public entry point: a SwiGLU MLP and its residual add for a few rows,
in one kernel (see gpu.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.swiglu_mlp.gpu import (PREFETCH_COLS, ROWS, SMEM_BYTES, STAGES, smem_bytes,
                                    swiglu_mlp_gpu)
from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS, swiglu_mlp_reference


def fits(m: int, d: int, dtype, stages: int = STAGES) -> bool:
  """Whether the kernel takes x [m, d] (rows, D, dtype, shared memory)."""
  return (1 <= m <= ROWS and d % TILE_COLS == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and smem_bytes(itemsize=jnp.dtype(dtype).itemsize, stages=stages) <= SMEM_BYTES)


def swiglu_mlp(x, w_stream, residual, *, prefetch=(), impl: str = "auto",
               stages: int = STAGES, interpret: bool = False) -> jax.Array:
  """``residual + (silu(x @ gate) * (x @ up)) @ down`` in f32 for x [M, D],
  M <= 64 rows, the weights packed by `reference.stream_layout`.

  impl: "auto" (the Mosaic GPU kernel on a Hopper GPU, else the reference),
  "gpu" (Hopper: TMA, WGMMA) or "reference". `stages`: weight tiles in flight.
  `prefetch`: arrays the kernel sends to L2 as it starts, for the kernels
  after it (e.g. the next layer's weights); a hint with no effect on the
  result, taken by the GPU kernel for arrays whose size is a multiple of
  128 elements.
  """
  if x.ndim != 2 or residual.shape != x.shape:
    raise ValueError(f"x and residual must both be [M, D], got {x.shape} and {residual.shape}")
  m, d = x.shape
  if (w_stream.ndim != 3 or w_stream.shape[1:] != (BLOCK * (d // BLOCK + d // TILE_COLS),
                                                   TILE_COLS)):
    raise ValueError(f"w_stream must be stream_layout's [F / {BLOCK}, "
                     f"{BLOCK * (d // BLOCK + d // TILE_COLS)}, {TILE_COLS}] for D = {d}, "
                     f"got {w_stream.shape}")
  if x.dtype != w_stream.dtype:
    raise ValueError(f"x and w_stream must have one dtype, got {x.dtype} and {w_stream.dtype}")
  if impl == "auto":
    impl = "gpu" if common.is_hopper() else "reference"
  impl = common.resolve_impl(impl)
  if impl != "gpu":
    return swiglu_mlp_reference(x, w_stream, residual)
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"the kernel takes bf16 or f16 x and w_stream, got {x.dtype}")
  if not fits(m, d, x.dtype, stages):
    need = smem_bytes(itemsize=x.dtype.itemsize, stages=stages)
    raise ValueError(f"the kernel takes 1..{ROWS} rows and D a multiple of {TILE_COLS} with "
                     f"{stages} x and weight tiles in {SMEM_BYTES} B of shared memory "
                     f"({need} B needed), got [M, D] = {x.shape}")
  pad = ((0, common.round_up(m, 8) - m), (0, 0))  # TMA stores rows in tiles of 8
  # a row-major array viewed as [N, 128] is the same buffer (no copy)
  prefetch = tuple(a.reshape(-1, PREFETCH_COLS) for a in prefetch if a.size % PREFETCH_COLS == 0)
  out = swiglu_mlp_gpu(jnp.pad(x, pad), w_stream, jnp.pad(residual, pad), prefetch,
                       stages=stages, interpret=interpret)
  return out[:m]
