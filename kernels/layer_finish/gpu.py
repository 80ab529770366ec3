"""Pallas (Triton lowering) layer finish: one persistent program per SM.

Grid (P,), P <= the SM count, so every program is resident at once. The
layer's four dependent stages run one after another, each spread over all
programs in units of work (program p takes units p, p + P, ...), with a grid
barrier between stages:
  1. "o":    y[:, tile] = x + attn @ w_o[:, tile], tiles of ``bn_o`` columns;
  2. "up":   h[:, tile] = SiLU(gate) * up over a tile of ``fu`` columns of F
             (gate/up columns interleaved), each program recomputing the
             RMSNorm of y's rows while it streams its w_gate_up columns;
  3. "down": the f32 partial h[:, slice] @ w_down[slice, tile] of a slice of
             ``ks`` rows of F and a tile of ``bn_d`` columns;
  4. "sum":  out[:, tile] = y + the sum of the slices' partials.
y, h and the partials are a few hundred KB that stay in L2; what streams
from HBM is the weights, once. The M rows (16 at a batch-16 draft pass) are
padded to a power of two >= 16, the smallest tensor-core tile, by masked
loads.

Why one kernel: at 16 rows each stage is a few microseconds of weight bytes,
and as XLA's separate GEMMs, split-K sums and elementwise fusions (six
kernels) the launches, ramps and sums take about three times the bytes' time
(kernels/NOTES.md). The barrier is an arrival counter: each program, after
a CTA barrier (its threads' stores first), adds one with an acq_rel atomic
and spins on atomic reads until all P have arrived; data another program
wrote is then read with volatile loads (no stale L1 line). The spin is
bounded: a program that gives up counts a timeout in the second counter,
which the tests check is zero.

Why Triton and not Mosaic GPU: Hopper's WGMMA takes 64-row operands, 4x the
draft's 16 rows, and a Mosaic GPU projection of 16 rows measured slower than
XLA's (kernels/NOTES.md); Triton's 16-row dots fit.

Without ``persistent`` (and in interpret mode, where programs run one after
another and a barrier cannot be met) each stage is its own pallas_call over
the same grid, the stage bodies unchanged.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common
from kernels.gpu_common import dot

SPIN_LIMIT = 1 << 22  # atomic reads before a program stops waiting (~seconds)


@dataclasses.dataclass(frozen=True)
class Shape:
  m: int       # rows
  M: int       # rows padded for the tiles
  D: int       # hidden size
  A: int       # attention width (heads x head_dim)
  F: int       # intermediate size
  P: int       # programs
  bk: int      # K tile of every product
  bn_o: int
  fu: int
  ks: int
  bn_d: int
  bn_s: int
  eps: float

  @property
  def n_slices(self) -> int:
    return self.F // self.ks


def _rows(s: Shape):
  rows = jnp.arange(s.M, dtype=jnp.int32)
  return rows, rows < s.m


def _load_rows(ref, s: Shape, c0, width, *lead, volatile=False):
  """ref[*lead, rows, c0:c0 + width] as [M, width]; padding rows read 0."""
  rows, ok = _rows(s)
  cols = c0 + jnp.arange(width, dtype=jnp.int32)
  return plt.load(ref.at[(*lead, rows[:, None], cols[None, :])], mask=ok[:, None], other=0.0,
                  volatile=volatile)


def _store_rows(ref, s: Shape, c0, value, *lead):
  rows, ok = _rows(s)
  cols = c0 + jnp.arange(value.shape[1], dtype=jnp.int32)
  plt.store(ref.at[(*lead, rows[:, None], cols[None, :])], value, mask=ok[:, None])


def _for_units(p, n_units: int, P: int, fn):
  """fn(u) for the units u = p, p + P, ... below n_units."""
  def body(i, carry):
    fn(p + i * P)
    return carry
  lax.fori_loop(0, (n_units - p + P - 1) // P, body, 0)


def _round(v, dtype):
  return v.astype(dtype).astype(jnp.float32)


def _o_stage(p, x_ref, attn_ref, wo_ref, y_ref, *, s: Shape, volatile: bool):
  del volatile  # x and attn come from before the kernel
  dt = x_ref.dtype

  def unit(n):
    c0 = n * s.bn_o

    def k_step(i, acc):
      a = _load_rows(attn_ref, s, i * s.bk, s.bk)
      return acc + dot(a, wo_ref[pl.ds(i * s.bk, s.bk), pl.ds(c0, s.bn_o)])

    acc = lax.fori_loop(0, s.A // s.bk, k_step, jnp.zeros((s.M, s.bn_o), jnp.float32))
    x = _load_rows(x_ref, s, c0, s.bn_o).astype(jnp.float32)
    _store_rows(y_ref, s, c0, (x + _round(acc, dt)).astype(dt))

  _for_units(p, s.D // s.bn_o, s.P, unit)


def _up_stage(p, y_ref, nw_ref, wgu_ref, h_ref, *, s: Shape, volatile: bool):
  dt = y_ref.dtype

  def sum_sq(i, acc):
    v = _load_rows(y_ref, s, i * s.bk, s.bk, volatile=volatile).astype(jnp.float32)
    return acc + jnp.sum(v * v, axis=1)

  ss = lax.fori_loop(0, s.D // s.bk, sum_sq, jnp.zeros((s.M,), jnp.float32))
  inv = lax.rsqrt(ss / s.D + s.eps)
  cols = jnp.arange(2 * s.fu, dtype=jnp.int32)[:, None]
  pair = 2 * jnp.arange(s.fu, dtype=jnp.int32)[None, :]
  take_gate = (cols == pair).astype(dt)
  take_up = (cols == pair + 1).astype(dt)

  def unit(u):
    c0 = u * 2 * s.fu

    def k_step(i, acc):
      ks = pl.ds(i * s.bk, s.bk)
      v = _load_rows(y_ref, s, i * s.bk, s.bk, volatile=volatile).astype(jnp.float32)
      normed = nw_ref[ks][None, :] * (v * inv[:, None]).astype(dt)
      return acc + dot(normed, wgu_ref[ks, pl.ds(c0, 2 * s.fu)])

    gu = lax.fori_loop(0, s.D // s.bk, k_step, jnp.zeros((s.M, 2 * s.fu), jnp.float32))
    gu = gu.astype(dt)
    # gate and up apart by 0/1 selection products (exact: one term each)
    gate, up = dot(gu, take_gate), dot(gu, take_up)
    # SiLU(gate) x up rounded op by op as the model's bf16 ops
    sigmoid = _round(1.0 / (1.0 + jnp.exp(-gate)), dt)
    _store_rows(h_ref, s, u * s.fu, (_round(gate * sigmoid, dt) * up).astype(dt))

  _for_units(p, s.F // s.fu, s.P, unit)


def _down_stage(p, h_ref, wd_ref, part_ref, *, s: Shape, volatile: bool):
  n_tiles = s.D // s.bn_d
  bk = min(s.bk, s.ks)

  def unit(u):
    sl, n = u // n_tiles, u % n_tiles
    r0, c0 = sl * s.ks, n * s.bn_d

    def k_step(i, acc):
      hv = _load_rows(h_ref, s, r0 + i * bk, bk, volatile=volatile)
      return acc + dot(hv, wd_ref[pl.ds(r0 + i * bk, bk), pl.ds(c0, s.bn_d)])

    acc = lax.fori_loop(0, s.ks // bk, k_step, jnp.zeros((s.M, s.bn_d), jnp.float32))
    _store_rows(part_ref, s, c0, acc, sl)

  _for_units(p, s.n_slices * n_tiles, s.P, unit)


def _sum_stage(p, y_ref, part_ref, out_ref, *, s: Shape, volatile: bool):
  dt = y_ref.dtype

  def unit(n):
    c0 = n * s.bn_s

    def add(sl, acc):
      return acc + _load_rows(part_ref, s, c0, s.bn_s, sl, volatile=volatile)

    acc = lax.fori_loop(0, s.n_slices, add, jnp.zeros((s.M, s.bn_s), jnp.float32))
    y = _load_rows(y_ref, s, c0, s.bn_s, volatile=volatile).astype(jnp.float32)
    _store_rows(out_ref, s, c0, (y + _round(acc, dt)).astype(dt))

  _for_units(p, s.D // s.bn_s, s.P, unit)


def _grid_barrier(cnt_ref, target):
  """Wait until the arrival counter cnt_ref[0] reaches `target`."""
  plt.debug_barrier()  # every thread's stores precede the arrival (release)
  seen = plt.atomic_add(cnt_ref, (0,), jnp.int32(1)) + 1

  def waiting(c):
    return (c[0] < target) & (c[1] < SPIN_LIMIT)

  def poll(c):
    return plt.atomic_add(cnt_ref, (0,), jnp.int32(0)), c[1] + 1

  seen, _ = lax.while_loop(waiting, poll, (seen, jnp.int32(0)))

  @pl.when(seen < target)
  def _():
    plt.atomic_add(cnt_ref, (1,), jnp.int32(1))

  plt.debug_barrier()


def _persistent_kernel(x_ref, attn_ref, wo_ref, nw_ref, wgu_ref, wd_ref, _cnt_in,
                       out_ref, y_ref, h_ref, part_ref, cnt_ref, *, s: Shape):
  p = pl.program_id(0)
  _o_stage(p, x_ref, attn_ref, wo_ref, y_ref, s=s, volatile=True)
  _grid_barrier(cnt_ref, s.P)
  _up_stage(p, y_ref, nw_ref, wgu_ref, h_ref, s=s, volatile=True)
  _grid_barrier(cnt_ref, 2 * s.P)
  _down_stage(p, h_ref, wd_ref, part_ref, s=s, volatile=True)
  _grid_barrier(cnt_ref, 3 * s.P)
  _sum_stage(p, y_ref, part_ref, out_ref, s=s, volatile=True)


def _best_split(total: int, unit_sizes, programs: int):
  """The unit size (dividing `total`) that minimises the most work any one
  program gets: ceil(units / programs) x size; ties to the larger unit."""
  sizes = [u for u in unit_sizes if total % u == 0]
  return min(sizes, key=lambda u: (common.cdiv(total // u, programs) * u, -u))


def default_tuning(m: int, d: int, a: int, f: int, programs: int | None = None) -> dict:
  """Programs: one per SM. Tiles: K tiles of up to 128, o and sum tiles of
  16 columns, and the F tile (up) and the (F slice, column tile) of down that
  spread their weight columns most evenly over the programs."""
  del m
  if d % 16 or a % 16 or f % 16:
    raise ValueError(f"D, A and F must be multiples of 16, got {d}, {a}, {f}")
  P = programs or common.num_sms()
  bk = 128
  while bk > 16 and (d % bk or a % bk):
    bk //= 2
  fu = _best_split(f, (16, 32, 64), P)
  # down: slices of F of at least 128 rows (fewer partials to sum) and tiles
  # of at least 32 columns, where the shape allows
  pow2 = lambda n, cap: min(cap, n & -n)
  best = None
  for ks in (128, 256, 512, 1024):
    ks = min(ks, pow2(f, 1024))
    for bn_d in (32, 64, 128):
      bn_d = min(bn_d, pow2(d, 128))
      load = common.cdiv((f // ks) * (d // bn_d), P) * ks * bn_d
      key = (load, f // ks)  # then the fewest partials to sum
      if best is None or key < best[0]:
        best = (key, ks, bn_d)
  _, ks, bn_d = best
  return dict(programs=P, block_k=bk, bn_o=16, fu=fu, ks=ks, bn_d=bn_d, bn_s=16,
              num_warps=4, num_stages=3)


def check_shapes(x, attn, w_o, norm_w, w_gate_up, w_down):
  """(m, D, A, F) of 2-d operands, or ValueError naming the mismatch."""
  if x.ndim != 2 or attn.ndim != 2 or attn.shape[0] != x.shape[0]:
    raise ValueError(f"x [M, D] and attn [M, A] expected, got {x.shape}, {attn.shape}")
  m, d = x.shape
  a = attn.shape[1]
  f = w_down.shape[0]
  want = {"w_o": (a, d), "norm_w": (d,), "w_gate_up": (d, 2 * f), "w_down": (f, d)}
  got = {"w_o": w_o.shape, "norm_w": norm_w.shape, "w_gate_up": w_gate_up.shape,
         "w_down": w_down.shape}
  for name, shape in want.items():
    if tuple(got[name]) != shape:
      raise ValueError(f"{name} must be {shape} for x {x.shape}, attn {attn.shape}, "
                       f"got {tuple(got[name])}")
  return m, d, a, f


@functools.partial(jax.jit, static_argnames=(
    "eps", "programs", "block_k", "bn_o", "fu", "ks", "bn_d", "bn_s", "num_warps",
    "num_stages", "persistent", "interpret", "return_counters"))
def layer_finish_gpu(x, attn, w_o, norm_w, w_gate_up, w_down, *, eps, programs, block_k,
                     bn_o, fu, ks, bn_d, bn_s, num_warps, num_stages, persistent=True,
                     interpret=False, return_counters=False):
  m, d, a, f = check_shapes(x, attn, w_o, norm_w, w_gate_up, w_down)
  for name, total, tile in (("D", d, block_k), ("A", a, block_k), ("D", d, bn_o),
                            ("F", f, fu), ("F", f, ks), ("D", d, bn_d), ("D", d, bn_s)):
    if total % tile or tile & (tile - 1) or tile < 16:
      raise ValueError(f"tile {tile} must be a power of two >= 16 dividing {name} = {total}")
  s = Shape(m=m, M=max(16, common.next_pow2(m)), D=d, A=a, F=f, P=programs, bk=block_k,
            bn_o=bn_o, fu=fu, ks=ks, bn_d=bn_d, bn_s=bn_s, eps=float(eps))
  dt = x.dtype
  y = jax.ShapeDtypeStruct((m, d), dt)
  h = jax.ShapeDtypeStruct((m, f), dt)
  part = jax.ShapeDtypeStruct((s.n_slices, m, d), jnp.float32)
  params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  call = functools.partial(pl.pallas_call, grid=(programs,), compiler_params=params,
                           interpret=interpret)
  if persistent and not interpret:
    cnt = jax.ShapeDtypeStruct((2,), jnp.int32)
    out, _, _, _, counters = call(
        functools.partial(_persistent_kernel, s=s), out_shape=[y, y, h, part, cnt],
        input_output_aliases={6: 4}, name="layer_finish",
    )(x, attn, w_o, norm_w, w_gate_up, w_down, jnp.zeros((2,), jnp.int32))
  else:
    def staged(stage, out_shape, *args):
      def kernel(*refs):
        stage(pl.program_id(0), *refs, s=s, volatile=False)
      return call(kernel, out_shape=out_shape, name=f"layer_finish_{stage.__name__[1:-6]}")(*args)

    y_val = staged(_o_stage, y, x, attn, w_o)
    h_val = staged(_up_stage, h, y_val, norm_w, w_gate_up)
    part_val = staged(_down_stage, part, h_val, w_down)
    out = staged(_sum_stage, y, y_val, part_val)
    if return_counters:
      raise ValueError("the barrier counters exist only in the persistent kernel")
  return (out, counters) if return_counters else out
