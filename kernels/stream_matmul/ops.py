"""Public entry point: a projection of a few rows, streamed (see gpu.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.stream_matmul.gpu import ROWS, SMEM_BYTES, smem_bytes, stream_matmul_gpu
from kernels.stream_matmul.reference import stream_matmul_reference

MAX_WEIGHT_BYTES = 12 * 2**20  # see stream_tiling


def stream_tiling(m: int, k: int, n: int, dtype) -> dict | None:
  """The kernel's tiling for x [m, k] @ w [k, n], or None where XLA's GEMM
  is as fast (results/h200/stream_matmul: at 16-32 rows the kernel takes
  the 0.5B draft's q/k/v, o and down in 55-70% of XLA's time; XLA reaches
  80% or more of the copy bandwidth on weights above ~12 MiB, where the
  kernel does not beat it). Tiles of 64 x 64, 4 in flight; K split into
  the fewest slices whose x fits shared memory beside them."""
  itemsize = jnp.dtype(dtype).itemsize
  if (m > ROWS or k * n * itemsize > MAX_WEIGHT_BYTES or k % 64 or n % 64
          or dtype not in (jnp.bfloat16, jnp.float16)):
    return None
  tiles = dict(tile_n=64, tile_k=64, stages=4)
  for splits in (s for s in range(1, k // 64 + 1) if (k // 64) % s == 0):
    if smem_bytes(k, itemsize=itemsize, swiglu=False, splits=splits, **tiles) <= SMEM_BYTES:
      return dict(tiles, splits=splits)
  return None


def stream_matmul(x, w, bias=None, *, swiglu: bool = False, splits: int = 1, impl: str = "auto",
                  interpret: bool = False, tile_n: int = 64, tile_k: int = 64,
                  stages: int = 4) -> jax.Array:
  """x [M, K] @ w [K, N] for M <= 64 rows (``reference.py``: the plain
  product (+ bias [N]), the SwiGLU epilogue over blocks of `tile_n` gate and up columns,
  or `splits` f32 partial products over slices of K).

  impl: "auto" (the Mosaic GPU kernel on a GPU, else the reference),
  "gpu" (Hopper: WGMMA and TMA) or "reference". Tiles: `tile_n` output
  columns per program (a multiple of 64), `tile_k` weight rows per
  pipeline step (a multiple of 64), `stages` weight tiles in flight.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"x must be [M, K] and w [K, N], got {x.shape} and {w.shape}")
  if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"x and w must both be bf16 or f16, got {x.dtype} and {w.dtype}")
  m, k = x.shape
  n = w.shape[1]
  if not 1 <= m <= ROWS:
    raise ValueError(f"stream_matmul takes 1..{ROWS} rows, got {m}")
  if tile_n % 64 or tile_k % 64:
    raise ValueError(f"tile_n={tile_n} and tile_k={tile_k} must be multiples of 64")
  if swiglu and splits > 1:
    raise ValueError("swiglu needs whole sums: splits must be 1")
  if bias is not None and (swiglu or splits > 1 or bias.shape != (w.shape[1],)
                           or bias.dtype != x.dtype):
    raise ValueError(f"a bias is [N] in x's dtype and needs a plain product (no swiglu, "
                     f"splits 1): got {bias.shape} {bias.dtype}, swiglu={swiglu}, "
                     f"splits={splits}")
  tile_w = 2 * tile_n if swiglu else tile_n
  if n % tile_w:
    raise ValueError(f"N={n} must be a multiple of {tile_w} (tile_n={tile_n}"
                     f"{', twice with swiglu' if swiglu else ''})")
  if k % (splits * tile_k):
    raise ValueError(f"K={k} must be a multiple of splits x tile_k = {splits * tile_k}")
  impl = common.resolve_impl(impl)
  if impl != "gpu":
    return stream_matmul_reference(x, w, bias, swiglu=swiglu, splits=splits, block=tile_n)
  need = smem_bytes(k, itemsize=x.dtype.itemsize, tile_n=tile_n, tile_k=tile_k,
                    stages=stages, swiglu=swiglu, splits=splits)
  if need > SMEM_BYTES:
    raise ValueError(f"{need} B of shared memory needed (x slice, {stages} weight tiles, "
                     f"the output tile), {SMEM_BYTES} B per SM: use more splits, fewer "
                     "stages or smaller tiles")
  rows = common.round_up(m, 8)  # TMA copies rows in tiles of 8
  out = stream_matmul_gpu(jnp.pad(x, ((0, rows - m), (0, 0))), w, bias, swiglu=swiglu,
                          splits=splits, tile_n=tile_n, tile_k=tile_k, stages=stages,
                          interpret=interpret)
  return out[..., :m, :]
