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
  bk_o: int    # K tiles (rows of a weight tile) of o, up and down: the
  bk_up: int   # bytes a program has in flight; a tile past the end of K
  bk_d: int    # is masked
  bn_o: int    # o: columns per unit
  bn_d: int    # down: columns per program
  bn_s: int    # sum: columns per unit
  eps: float

  @property
  def f_per_program(self) -> int:
    """up: the F columns each program owns (the last ones fewer or none), a
    multiple of 8 so that every program's columns start 16-byte aligned and
    load as vectors."""
    return common.round_up(common.cdiv(self.F, self.P), 8)

  @property
  def up_tile(self) -> int:
    """up: the gate/up columns a program loads per K tile (a power of two)."""
    return max(16, common.next_pow2(2 * self.f_per_program))

  @property
  def down_rows(self) -> int:
    """down: the F rows of one slice (a multiple of bk_d); one program per
    (slice, column tile)."""
    slices = max(1, self.P // (self.D // self.bn_d))
    return common.round_up(common.cdiv(self.F, slices), self.bk_d)

  @property
  def n_slices(self) -> int:
    return common.cdiv(self.F, self.down_rows)


def _mask(r_ok, c_ok):
  if r_ok is None:
    return c_ok[None, :]
  return r_ok[:, None] if c_ok is None else r_ok[:, None] & c_ok[None, :]


def _load(ref, r0, nr, c0, nc, *lead, r_ok=None, c_ok=None):
  """ref[*lead, r0:r0 + nr, c0:c0 + nc]; rows outside `r_ok` and columns
  outside `c_ok` read 0. Without masks (the tile in bounds for every
  program) a plain slice load, which Triton vectorises best."""
  if r_ok is None and c_ok is None:
    return ref[(*lead, pl.ds(r0, nr), pl.ds(c0, nc))]
  rows = r0 + jnp.arange(nr, dtype=jnp.int32)
  cols = c0 + jnp.arange(nc, dtype=jnp.int32)
  return plt.load(ref.at[(*lead, rows[:, None], cols[None, :])], mask=_mask(r_ok, c_ok),
                  other=0.0)


def _store(ref, r0, c0, value, *lead, r_ok=None, c_ok=None):
  nr, nc = value.shape
  if r_ok is None and c_ok is None:
    ref[(*lead, pl.ds(r0, nr), pl.ds(c0, nc))] = value
    return
  rows = r0 + jnp.arange(nr, dtype=jnp.int32)
  cols = c0 + jnp.arange(nc, dtype=jnp.int32)
  plt.store(ref.at[(*lead, rows[:, None], cols[None, :])], value, mask=_mask(r_ok, c_ok))


def _row_ok(s: Shape):
  """The real rows of the M-row tiles (None: all are)."""
  return None if s.m == s.M else jnp.arange(s.M, dtype=jnp.int32) < s.m


def _load_rows(ref, s: Shape, c0, width, *lead, col_ok=None):
  """ref[*lead, rows, c0:c0 + width] as [M, width]; padding rows (and
  columns outside `col_ok`) read 0."""
  return _load(ref, 0, s.M, c0, width, *lead, r_ok=_row_ok(s), c_ok=col_ok)


def _store_rows(ref, s: Shape, c0, value, *lead, col_ok=None):
  _store(ref, 0, c0, value, *lead, r_ok=_row_ok(s), c_ok=col_ok)


def _k_ok(k0, bk, total, exact):
  """The K rows of a tile that exist (None where every tile is whole)."""
  return None if exact else k0 + jnp.arange(bk, dtype=jnp.int32) < total


def _for_units(p, n_units: int, P: int, fn):
  """fn(u) for the units u = p, p + P, ... below n_units."""
  def body(i, carry):
    fn(p + i * P)
    return carry
  lax.fori_loop(0, (n_units - p + P - 1) // P, body, 0)


def _round(v, dtype):
  return v.astype(dtype).astype(jnp.float32)


def _o_stage(p, x_ref, attn_ref, wo_ref, y_ref, *, s: Shape):
  dt = x_ref.dtype

  def unit(n):
    c0 = n * s.bn_o

    def k_step(i, acc):
      k0 = i * s.bk_o
      k_ok = _k_ok(k0, s.bk_o, s.A, s.A % s.bk_o == 0)
      a = _load_rows(attn_ref, s, k0, s.bk_o, col_ok=k_ok)
      return acc + dot(a, _load(wo_ref, k0, s.bk_o, c0, s.bn_o, r_ok=k_ok))

    acc = lax.fori_loop(0, common.cdiv(s.A, s.bk_o), k_step,
                        jnp.zeros((s.M, s.bn_o), jnp.float32))
    x = _load_rows(x_ref, s, c0, s.bn_o).astype(jnp.float32)
    _store_rows(y_ref, s, c0, (x + _round(acc, dt)).astype(dt))

  _for_units(p, s.D // s.bn_o, s.P, unit)


def _up_stage(p, y_ref, nw_ref, wgu_ref, h_ref, *, s: Shape):
  """Program p: h[:, f0:f1] for its F columns f0 = p * Fp .. f1, one pass
  over K. The norm's row scale commutes with the product, so the rows of
  y * norm_w are multiplied as they stream and scaled by 1 / rms after."""
  dt = y_ref.dtype
  fp, tile = s.f_per_program, s.up_tile
  f0 = pl.multiple_of(p * fp, 8)
  j = jnp.arange(tile, dtype=jnp.int32)
  # the program's gate/up columns exactly fill the tile, every program's
  exact = tile == 2 * fp and s.F % fp == 0
  c_ok = None if exact else (j < 2 * fp) & (2 * f0 + j < 2 * s.F)

  def k_step(i, carry):
    acc, ss = carry
    k0 = i * s.bk_up
    k_ok = _k_ok(k0, s.bk_up, s.D, s.D % s.bk_up == 0)
    v = _load_rows(y_ref, s, k0, s.bk_up, col_ok=k_ok)
    vf = v.astype(jnp.float32)
    w = _load(wgu_ref, k0, s.bk_up, 2 * f0, tile, r_ok=k_ok, c_ok=c_ok)
    if k_ok is None:
      nw = nw_ref[pl.ds(k0, s.bk_up)]
    else:
      nw = plt.load(nw_ref.at[k0 + jnp.arange(s.bk_up, dtype=jnp.int32)], mask=k_ok, other=0.0)
    acc = acc + dot(nw[None, :] * v, w)
    return acc, ss + jnp.sum(vf * vf, axis=1)

  @pl.when(f0 < s.F)
  def _():
    acc, ss = lax.fori_loop(0, common.cdiv(s.D, s.bk_up), k_step, (jnp.zeros((s.M, tile), jnp.float32),
                                                     jnp.zeros((s.M,), jnp.float32)))
    gu = (acc * lax.rsqrt(ss / s.D + s.eps)[:, None]).astype(dt)
    # gate and up apart by 0/1 selection products (exact: one term each)
    r = jnp.arange(tile, dtype=jnp.int32)[:, None]
    pair = 2 * jnp.arange(tile // 2, dtype=jnp.int32)[None, :]
    gate, up = dot(gu, (r == pair).astype(dt)), dot(gu, (r == pair + 1).astype(dt))
    # SiLU(gate) x up rounded op by op as the model's bf16 ops
    sigmoid = _round(1.0 / (1.0 + jnp.exp(-gate)), dt)
    h = (_round(gate * sigmoid, dt) * up).astype(dt)
    jh = jnp.arange(tile // 2, dtype=jnp.int32)
    _store_rows(h_ref, s, f0, h, col_ok=None if exact else (jh < fp) & (f0 + jh < s.F))


def _down_stage(p, h_ref, wd_ref, part_ref, *, s: Shape):
  """Program p < n_slices x tiles: the f32 partial of its F slice and
  column tile, one pass over the slice's rows."""
  n_tiles = s.D // s.bn_d
  sl, n = p // n_tiles, p % n_tiles
  r0, c0 = sl * s.down_rows, n * s.bn_d

  @pl.when(p < s.n_slices * n_tiles)
  def _():
    def k_step(i, acc):
      k0 = r0 + i * s.bk_d
      k_ok = _k_ok(k0, s.bk_d, s.F, s.n_slices * s.down_rows == s.F)
      hv = _load_rows(h_ref, s, k0, s.bk_d, col_ok=k_ok)
      return acc + dot(hv, _load(wd_ref, k0, s.bk_d, c0, s.bn_d, r_ok=k_ok))

    acc = lax.fori_loop(0, s.down_rows // s.bk_d, k_step, jnp.zeros((s.M, s.bn_d), jnp.float32))
    _store_rows(part_ref, s, c0, acc, sl)


def _sum_stage(p, y_ref, part_ref, out_ref, *, s: Shape):
  dt = y_ref.dtype

  def unit(n):
    c0 = n * s.bn_s

    def add(sl, acc):
      return acc + _load_rows(part_ref, s, c0, s.bn_s, sl)

    acc = lax.fori_loop(0, s.n_slices, add, jnp.zeros((s.M, s.bn_s), jnp.float32))
    y = _load_rows(y_ref, s, c0, s.bn_s).astype(jnp.float32)
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
  _o_stage(p, x_ref, attn_ref, wo_ref, y_ref, s=s)
  _grid_barrier(cnt_ref, s.P)
  _up_stage(p, y_ref, nw_ref, wgu_ref, h_ref, s=s)
  _grid_barrier(cnt_ref, 2 * s.P)
  _down_stage(p, h_ref, wd_ref, part_ref, s=s)
  _grid_barrier(cnt_ref, 3 * s.P)
  _sum_stage(p, y_ref, part_ref, out_ref, s=s)


def default_tuning(m: int, d: int, a: int, f: int, programs: int | None = None) -> dict:
  """One program per SM; K tiles of 128 rows; o and sum units of 16
  columns; down tiles of 64 columns (or the widest power of two dividing D),
  the F slices as many as leave every program a tile."""
  del m
  if d % 16 or a % 16 or f % 16:
    raise ValueError(f"D, A and F must be multiples of 16, got {d}, {a}, {f}")
  P = programs or common.num_sms()
  bn_d = min(64, d & -d)
  while d // bn_d > P and bn_d < 128 and d % (2 * bn_d) == 0:
    bn_d *= 2
  return dict(programs=P, bk_o=128, bk_up=128, bk_d=128, bn_o=16, bn_d=bn_d, bn_s=16,
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
    "eps", "programs", "bk_o", "bk_up", "bk_d", "bn_o", "bn_d", "bn_s", "num_warps",
    "num_stages", "persistent", "interpret", "return_counters"))
def layer_finish_gpu(x, attn, w_o, norm_w, w_gate_up, w_down, *, eps, programs, bk_o, bk_up, bk_d,
                     bn_o, bn_d, bn_s, num_warps, num_stages, persistent=True,
                     interpret=False, return_counters=False):
  m, d, a, f = check_shapes(x, attn, w_o, norm_w, w_gate_up, w_down)
  for name, tile in (("bk_o", bk_o), ("bk_up", bk_up), ("bk_d", bk_d), ("bn_o", bn_o),
                     ("bn_d", bn_d), ("bn_s", bn_s)):
    if tile & (tile - 1) or tile < 16 or (name[:2] == "bn" and d % tile):
      raise ValueError(f"{name} = {tile} must be a power of two >= 16"
                       + (f" dividing D = {d}" if name[:2] == "bn" else ""))
  s = Shape(m=m, M=max(16, common.next_pow2(m)), D=d, A=a, F=f, P=programs, bk_o=bk_o, bk_up=bk_up, bk_d=bk_d,
            bn_o=bn_o, bn_d=bn_d, bn_s=bn_s, eps=float(eps))
  if d // bn_d > programs or s.up_tile > 256:
    raise ValueError(f"{programs} programs are too few for D = {d}, F = {f} with down tiles "
                     f"of {bn_d} columns (each program owns one down tile and at most 128 "
                     "columns of F)")
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
        stage(pl.program_id(0), *refs, s=s)
      return call(kernel, out_shape=out_shape, name=f"layer_finish_{stage.__name__[1:-6]}")(*args)

    y_val = staged(_o_stage, y, x, attn, w_o)
    h_val = staged(_up_stage, h, y_val, norm_w, w_gate_up)
    part_val = staged(_down_stage, part, h_val, w_down)
    out = staged(_sum_stage, y, y_val, part_val)
    if return_counters:
      raise ValueError("the barrier counters exist only in the persistent kernel")
  return (out, counters) if return_counters else out
