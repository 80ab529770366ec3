"""kernels/streamk_matmul: the stream-K schedule, the Mosaic GPU kernel against
its reference (interpreted on CPU, compiled on a Hopper GPU) and the public
entry's checks."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.common import is_hopper
from kernels.streamk_matmul.gpu import streamk_matmul_gpu
from kernels.streamk_matmul.ops import fits, streamk_matmul
from kernels.streamk_matmul.reference import Schedule, streamk_matmul_reference

ON_HOPPER = jax.default_backend() == "gpu" and is_hopper()


def operands(seed, m, k, n, dtype=jnp.bfloat16):
  kx, kw, ka = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  acc = jax.random.normal(ka, (m, n), jnp.float32).astype(dtype)
  return x, w, acc


def as_f32(a):
  return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.parametrize("k,n,programs", [(18944, 3584, 132), (3584, 4608, 132), (256, 256, 5),
                                          (128, 128, 7)])
def test_schedule_gives_every_unit_to_one_program_in_equal_runs(k, n, programs):
  s = Schedule.of(k, n, programs)
  counts = [s.count(p) for p in range(s.programs)]
  assert max(counts) - min(counts) <= 1 and max(counts) == s.steps
  assert s.programs == min(programs, s.units)
  covered = np.concatenate([np.arange(s.start(p), s.start(p) + s.count(p))
                            for p in range(s.programs)])
  np.testing.assert_array_equal(covered, np.arange(s.units))
  for p in range(s.programs):
    units = np.arange(s.start(p), s.start(p) + s.count(p))
    assert list(s.tiles_of(p)) == sorted(set(units // s.k_steps))


# (m, k, n, programs, stages): 24 rows, runs of 2 units inside one tile; 80
# rows (two 64-row accumulators), a run that crosses into a second tile
@pytest.mark.parametrize("m,k,n,programs,stages", [(24, 256, 256, 5, 2), (80, 192, 384, 4, 2)])
def test_kernel_interpreted_equals_reference(m, k, n, programs, stages):
  x, w, acc = operands(m + k + n, m, k, n)
  if m == 80:  # the case is what it claims: some run adds into two tiles
    s = Schedule.of(k, n, programs)
    assert max(len(s.tiles_of(p)) for p in range(s.programs)) == 2
  got = streamk_matmul(x, w, acc, impl="gpu", interpret=True, programs=programs, stages=stages)
  want = streamk_matmul_reference(x, w, acc)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=1e-5, atol=1e-5)


def test_kernel_lowers_to_one_mosaic_gpu_call_that_adds_into_acc():
  """At the 7B verify's down projection (80 rows): acc's f32 copy is the
  call's aliased output and the tiles' sums reach it by TMA reduce-adds."""
  x = jax.ShapeDtypeStruct((80, 18944), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((18944, 3584), jnp.bfloat16)
  acc = jax.ShapeDtypeStruct((80, 3584), jnp.bfloat16)
  fn = lambda x, w, acc: streamk_matmul_gpu(x, w, acc, programs=132, stages=4)
  text = jax.jit(fn).trace(x, w, acc).lower(lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
  assert "output_operand_alias" in text and "cp.reduce.async.bulk.tensor" in text


def test_ops_checks_and_dispatch():
  x, w, acc = operands(2, 16, 128, 256)
  if jax.default_backend() == "cpu":  # auto: the reference
    np.testing.assert_array_equal(as_f32(streamk_matmul(x, w, acc)),
                                  as_f32(streamk_matmul_reference(x, w, acc)))
  with pytest.raises(ValueError, match=r"\[M, K\]"):
    streamk_matmul(x, w[:64], acc)
  with pytest.raises(ValueError, match="acc"):
    streamk_matmul(x, w, acc[:8])
  with pytest.raises(ValueError, match="one dtype"):
    streamk_matmul(x.astype(jnp.float32), w, acc)
  with pytest.raises(ValueError, match="1..128 rows"):
    streamk_matmul(jnp.zeros((129, 128), jnp.bfloat16), w, jnp.zeros((129, 256)), impl="gpu")
  with pytest.raises(ValueError, match="multiple"):
    streamk_matmul(x, w[:, :192], acc[:, :192], impl="gpu")
  assert fits(80, 18944, 3584, jnp.bfloat16) and fits(1, 3584, 4608, jnp.float16)
  assert not fits(80, 18944, 3584, jnp.float32) and not fits(16, 896, 1152 + 64, jnp.bfloat16)


# ------------------------------------------------------- compiled (Hopper)
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (TMA, WGMMA)")
@pytest.mark.parametrize("m,k,n", [(80, 18944, 3584), (80, 3584, 4608), (16, 3584, 3584),
                                   (5, 896, 1152)])
def test_kernel_compiled_equals_reference(m, k, n):
  x, w, acc = operands(m, m, k, n)
  got = jax.jit(streamk_matmul)(x, w, acc)
  want = streamk_matmul_reference(x, w, acc)
  np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=2e-3, atol=2e-3)
