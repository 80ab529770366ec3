"""Public entry point: a SwiGLU MLP and its residual add for a few rows,
in one kernel (see gpu.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.swiglu_mlp.gpu import (GRID_STAGES, PREFETCH_COLS, ROWS, SMEM_BYTES, STAGES,
                                    grid_smem_bytes, smem_bytes, swiglu_mlp_gpu,
                                    swiglu_mlp_grid_gpu)

SCHEDULES = ("grid", "blocks")
from kernels.swiglu_mlp.reference import BLOCK, TILE_COLS, swiglu_mlp_reference


def _smem(dtype, stages, schedule):
  itemsize = jnp.dtype(dtype).itemsize
  stages = stages or (GRID_STAGES if schedule == "grid" else STAGES)
  return (grid_smem_bytes if schedule == "grid" else smem_bytes)(itemsize=itemsize, stages=stages)


def fits(m: int, d: int, dtype, stages: int | None = None, schedule: str = "blocks") -> bool:
  """Whether the kernel takes x [m, d] (rows, D, dtype, shared memory)."""
  return (1 <= m <= ROWS and d % TILE_COLS == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and _smem(dtype, stages, schedule) <= SMEM_BYTES)


def swiglu_mlp(x, w_stream, residual, *, prefetch=(), impl: str = "auto",
               schedule: str = "blocks", stages: int | None = None, programs: int | None = None,
               interpret: bool = False) -> jax.Array:
  """``residual + (silu(x @ gate) * (x @ up)) @ down`` in f32 for x [M, D],
  M <= 64 rows, the weights packed by `reference.stream_layout`.

  impl: "auto" (the Mosaic GPU kernel on a Hopper GPU, else the reference),
  "gpu" (Hopper: TMA, WGMMA) or "reference". `schedule`: "grid" (one
  program per SM, two phases and a grid barrier: `swiglu_mlp_grid_gpu`) or
  "blocks" (one program per F block of 64: `swiglu_mlp_gpu`). `stages`:
  weight tiles in flight (default: the schedule's). `programs` (grid): at
  most the GPU's SMs (default: all of them).
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
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"the kernel takes bf16 or f16 x and w_stream, got {x.dtype}")
  if not fits(m, d, x.dtype, stages, schedule):
    need = _smem(x.dtype, stages, schedule)
    raise ValueError(f"the kernel takes 1..{ROWS} rows and D a multiple of {TILE_COLS} with "
                     f"{stages} x and weight tiles in {SMEM_BYTES} B of shared memory "
                     f"({need} B needed), got [M, D] = {x.shape}")
  pad = ((0, common.round_up(m, 8) - m), (0, 0))  # TMA stores rows in tiles of 8
  # a row-major array viewed as [N, 128] is the same buffer (no copy)
  prefetch = tuple(a.reshape(-1, PREFETCH_COLS) for a in prefetch if a.size % PREFETCH_COLS == 0)
  args = (jnp.pad(x, pad), w_stream, jnp.pad(residual, pad), prefetch)
  if schedule == "blocks":
    out = swiglu_mlp_gpu(*args, stages=stages or STAGES, interpret=interpret)
  else:
    sms = common.num_sms()
    programs = programs or sms
    if not interpret and programs > sms:  # the grid barrier needs every program resident
      raise ValueError(f"programs ({programs}) must not exceed the GPU's {sms} SMs")
    out = swiglu_mlp_grid_gpu(*args, programs=programs, stages=stages or GRID_STAGES,
                              interpret=interpret)
  return out[:m]
