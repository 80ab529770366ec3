"""kernels/mosaic_common: the Mosaic GPU kernels' shared compiler parameters
and phase regions."""
import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.mosaic_common import compiler_params, phase, tiled


def test_compiler_params_profile_only_with_a_directory():
  plain = compiler_params()
  assert plain.profile_space == 0 and plain.profile_dir == ""
  assert plain.lowering_semantics == plgpu.LoweringSemantics.Warpgroup
  profiled = compiler_params("/tmp/traces", regions=32)
  assert (profiled.profile_space, profiled.profile_dir) == (32, "/tmp/traces")


def test_phase_names_the_region_of_what_it_runs():
  @phase("gate_up")
  def double(x):
    return x * 2

  assert double.__name__ == "double"
  jaxpr = jax.make_jaxpr(double)(jnp.ones(3))
  (eqn,) = jaxpr.eqns
  assert "gate_up" in str(eqn.source_info.name_stack)


def test_tiled_swizzles_a_row_of_128_bytes():
  tiling, swizzle = tiled(64)  # 64 bf16 elements: 128-byte rows
  assert isinstance(tiling, plgpu.TilingTransform) and tiling.tiling == (8, 64)
  assert isinstance(swizzle, plgpu.SwizzleTransform) and swizzle.swizzle == 128
  assert tiled(64, 4)[0].tiling == (8, 32)  # f32: 256-byte rows, a 128-byte swizzle
