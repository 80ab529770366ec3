"""Pieces shared by the Mosaic GPU (Hopper) kernels."""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_BYTES = 227 * 1024  # shared memory one program may take on Hopper


def tiled(cols: int, itemsize: int = 2):
  """TMA / WGMMA tiling and swizzle of a shared-memory tile whose rows hold
  `cols` elements of `itemsize` bytes."""
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def phase(name: str):
  """Runs the decorated function under `jax.named_scope(name)`: a region of
  Mosaic GPU's in-kernel profiler when the kernel is profiled (see
  `compiler_params`), else only a name."""
  def wrap(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
      with jax.named_scope(name):
        return fn(*args, **kwargs)
    return run
  return wrap


def compiler_params(profile_dir: str = "", regions: int = 64):
  """Warpgroup semantics; with `profile_dir`, each call writes a trace of
  the warpgroups' `phase` regions there (at most `regions` per warpgroup;
  the profiler's buffer takes shared memory)."""
  profile = dict(profile_space=regions, profile_dir=profile_dir) if profile_dir else {}
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **profile)
