"""Mosaic GPU kernel of a streaming draft's sink + window attention for
Hopper, writing the output as token rows [B * T, Hq * D]: the layout of the
o projection that follows (`kernels.layer_seam` reads it as is).

`splits` programs per (sequence b, KV head h), one warpgroup each. Every
load is issued at the start by TMA (program 0: the block's new k/v rows and
the sink rows; each program: the queries and its 128-row window tiles p,
p + splits, ...), then an online softmax over them as they land,
with WGMMA for q k^T and p v (p through shared memory). At one split a
program walks the whole window from shared memory (~210 KB) and nothing is
merged; with more, the other programs store their partial (o, and m | l
over the columns; the query rows only) and signal a GMEM semaphore, and program 0 waits and merges them: no XLA
kernel after (the Triton kernel's partials need one). Program 0 stores the
output rows and the T new k/v rows into the caches (aliased, in place).

Layouts met on the way (jax's Mosaic GPU lowering):
  * a TMA into a tiled (swizzled) shared-memory tile wants a GMEM row start
    the compiler can prove a multiple of 8: the window tiles start at
    (w0 // 8) * 8 and mask the rows before w0;
  * WGMMA logits of 16 columns fail layout inference: the block and sink
    tiles are 64 rows, of which the first 8 (the new rows) or n_sink rounded
    to 8 are loaded, the rest stale and masked;
  * T-row stores at rows L or b * T go through untiled shared memory;
  * V rows outside the window (or stale) are zeroed before p v (a masked p
    is 0, but 0 * NaN of a stale row is not).
jax 0.10.2's interpret mode has no transposed WGMMA operand and no
`layout_cast`, so this kernel has no interpret path: its tests lower it for
CUDA on the CPU, check its tiling arithmetic in jnp, and compare it with the
reference on a Hopper GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels import common
from kernels.mosaic_common import SMEM_BYTES, tiled

ROWS = 64  # WGMMA's row operand: the G * T query rows, padded
BLOCK_ROWS = 64  # the block's k/v tiles and the sink tiles (see the docstring)
NEW_ROWS = 8  # the new k/v rows passed in, T of them real (T <= MAX_T)
WINDOW_TILE = 128
MAX_T = 8


def pack_window_inputs(qkv, cos, sin):
  """The kernel's one input array from the packed block qkv [B, T, Hkv,
  G + 2, D] (before RoPE) and cos, sin [B, T, D // 2]: blocks [B, Hkv,
  QR + 16, D], per (b, h) the roped queries as rows g * T + t (QR = G * T
  rounded up to 8), then 8 rows of the roped new k rows, then 8 of the new
  v rows (rows >= T zero). RoPE by `common.rope`. One output, so one XLA
  fusion in a jitted caller."""
  b, t, hkv, g2, d = qkv.shape
  g = g2 - 2
  # the queries and k_new of every KV head as [B, T, heads, D] for common.rope
  roped = common.rope(qkv[..., :g + 1, :].reshape(b, t, hkv * (g + 1), d), cos, sin)
  roped = roped.reshape(b, t, hkv, g + 1, d)
  q = roped[..., :g, :].transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, common.round_up(g * t, 8) - g * t), (0, 0)))
  new_rows = lambda x: jnp.pad(x.transpose(0, 2, 1, 3),  # noqa: E731
                               ((0, 0), (0, 0), (0, NEW_ROWS - t), (0, 0)))
  return jnp.concatenate([q, new_rows(roped[..., g, :]), new_rows(qkv[..., g + 1, :])], axis=2)


def window_tiles(n_window: int) -> int:
  """128-row tiles that cover a window of n_window rows starting anywhere
  (its first tile starts up to 7 rows early)."""
  return common.cdiv(n_window + 7, WINDOW_TILE)


def smem_bytes(d: int, mine: int, splits: int, itemsize: int = 2) -> int:
  """Shared memory of a program that walks `mine` window tiles (the
  kernel's scoped allocations; barriers aside)."""
  tiles = (ROWS + 4 * BLOCK_ROWS + 2 * mine * WINDOW_TILE) * d  # q, block, sink, window k/v
  tiles += ROWS * (BLOCK_ROWS + WINDOW_TILE)  # p of the block / sink and of a window tile
  tiles += ROWS * d + 2 * NEW_ROWS * d  # output rows, new k/v rows
  partial = (2 * ROWS * d if splits > 1 else NEW_ROWS * d) * 4  # f32
  return tiles * itemsize + partial


def program_fits(d: int, n_window: int, splits: int, itemsize: int = 2) -> bool:
  """Whether a program's window tiles fit shared memory at `splits` (1 KB
  left for barriers and alignment)."""
  mine = common.cdiv(window_tiles(n_window), splits)
  return smem_bytes(d, mine, splits, itemsize) <= SMEM_BYTES - 1024


def default_splits(batch: int, kv_heads: int, n_window: int, d: int = 64,
                   sms: int | None = None) -> int | None:
  """One window tile per program where the programs fit the SMs at once
  (program 0 waits for the others), else the fewest programs per (b, h)
  whose tiles fit shared memory (more than one: all resident at once);
  None where no split count does."""
  tiles = window_tiles(n_window)
  sms = sms or common.num_sms()
  if batch * kv_heads * tiles <= sms:
    return tiles
  for splits in range(1, tiles + 1):
    if program_fits(d, n_window, splits) and (splits == 1 or batch * kv_heads * splits <= sms):
      return splits
  return None


def fits(batch: int, t: int, kv_heads: int, group: int, head_dim: int, dtype, n_sink: int,
         n_window: int, cache_rows: int) -> bool:
  """Whether the kernel takes these shapes at its default splits
  (`check_args` says why not)."""
  splits = default_splits(batch, kv_heads, n_window, head_dim)
  if splits is None:
    return False
  try:
    check_args(jax.ShapeDtypeStruct((batch, t, kv_heads, group + 2, head_dim), dtype),
               jax.ShapeDtypeStruct((batch, kv_heads, cache_rows, head_dim), dtype),
               n_sink, n_window, splits)
  except ValueError:
    return False
  return True


def check_args(qkv, k_cache, n_sink: int, n_window: int, splits: int, sms: int | None = None):
  """Raises ValueError naming what the kernel cannot take (qkv [B, T, Hkv,
  G + 2, D] and the caches' dtype; the window; the splits)."""
  b, t, hkv, g2, d = qkv.shape
  if d != 64:
    raise ValueError(f"the Mosaic window kernel takes head_dim 64 (shared memory), got {d}")
  if t > MAX_T or (g2 - 2) * t > ROWS:
    raise ValueError(f"the Mosaic window kernel takes T <= {MAX_T} and G * T <= {ROWS}, "
                     f"got T={t}, G={g2 - 2}")
  if not 0 <= n_sink <= BLOCK_ROWS or n_window < 1:
    raise ValueError(f"n_sink must be in [0, {BLOCK_ROWS}] and n_window >= 1, got "
                     f"{n_sink}, {n_window}")
  if k_cache.shape[2] % 8:  # TMA into 8-row tiles: the caches' row count a multiple of 8
    raise ValueError(f"the Mosaic window kernel takes caches of a multiple of 8 rows, got "
                     f"{k_cache.shape[2]}")
  if qkv.dtype not in (jnp.bfloat16, jnp.float16) or k_cache.dtype != qkv.dtype:
    raise ValueError(f"the Mosaic window kernel takes bf16 / f16 q/k/v and caches, got "
                     f"{qkv.dtype}, {k_cache.dtype}")
  if not 1 <= splits <= window_tiles(n_window):
    raise ValueError(f"splits must be in [1, {window_tiles(n_window)}], got {splits}")
  if not program_fits(d, n_window, splits, jnp.dtype(qkv.dtype).itemsize):
    raise ValueError(f"splits={splits}: a program's {common.cdiv(window_tiles(n_window), splits)} "
                     f"window tiles of {WINDOW_TILE} rows do not fit shared memory; "
                     f"more splits or a shorter window")
  if splits > 1 and b * hkv * splits > (sms or common.num_sms()):
    raise ValueError(f"splits={splits}: {b * hkv * splits} programs must be resident at "
                     f"once (program 0 waits for the others); at most the SM count")


@functools.partial(jax.jit, static_argnames=("g", "t", "n_sink", "n_window", "splits"))
def window_attention_rows_gpu(blocks, k_cache, v_cache, lengths, *, g: int, t: int,
                              n_sink: int, n_window: int, splits: int):
  """blocks from `pack_window_inputs`; caches [B, Hkv, S, D]. Returns
  (out [B * T, Hq * D], k_cache, v_cache) with rows L .. L + T - 1 written."""
  nb, hkv, rows_in, d = blocks.shape
  qr = rows_in - 2 * NEW_ROWS  # the query rows; then the new k rows, the new v rows
  n_tiles = window_tiles(n_window)
  mine = common.cdiv(n_tiles, splits)  # window tiles a program walks
  ns = common.round_up(n_sink, 8)  # sink rows loaded (into a 64-row tile)
  scale = common.LOG2E / d ** 0.5
  dtype = blocks.dtype
  f32 = jnp.float32

  def body(len_ref, in_ref, kc_ref, vc_ref, out_ref, *partials):
    b, h, p = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    length = len_ref[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8  # provably a multiple of 8 (see the module docstring)
    first = p == 0

    def scope(q_smem, kb_smem, vb_smem, sk_smem, sv_smem, kw_smem, vw_smem, pb_smem, pw_smem,
              o_rows, kv_rows, part_smem, bar_q, bar_first, bar_tiles, bar_rows, bar_parts):
      plgpu.copy_gmem_to_smem(in_ref.at[b, h, pl.ds(0, qr)], q_smem.at[pl.ds(0, qr)], bar_q)

      @pl.when(first)
      def _load_block_and_sink():
        # only the rows that can be live: the rest of each 64-row tile is
        # stale shared memory, masked in the logits and zeroed in V below
        for j, dst in enumerate((kb_smem, vb_smem)):
          plgpu.copy_gmem_to_smem(in_ref.at[b, h, pl.ds(qr + j * NEW_ROWS, NEW_ROWS)],
                                  dst.at[pl.ds(0, NEW_ROWS)], bar_first)
        if ns:
          plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pl.ds(0, ns)], sk_smem.at[pl.ds(0, ns)],
                                  bar_first)
          plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pl.ds(0, ns)], sv_smem.at[pl.ds(0, ns)],
                                  bar_first)
        for j in range(2):
          plgpu.copy_gmem_to_smem(in_ref.at[b, h, pl.ds(qr + j * NEW_ROWS, NEW_ROWS)], kv_rows.at[j],
                                  bar_rows)

      for i in range(mine):  # rows past S arrive as zeros (TMA); rows outside the window are masked
        rows = pl.ds(w0a + (p + i * splits) * WINDOW_TILE, WINDOW_TILE)
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, rows], kw_smem[i], bar_tiles.at[i])
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, rows], vw_smem[i], bar_tiles.at[i])

      def keep_rows(v_smem, live):
        """Zeroes the V rows r with live(r) false (stale rows may hold NaN)."""
        v = v_smem[...]
        v_smem[...] = jnp.where(live(lax.broadcasted_iota(jnp.int32, v.shape, 0)), v, 0)
        plgpu.commit_smem()

      def update(carry, s, p_smem, v_smem):
        o, m, l = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
        alpha = jnp.exp2(m - m_safe)
        pr = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + jnp.sum(pr, axis=1)
        p_smem[...] = pr.astype(dtype)
        plgpu.commit_smem()

        def pv(acc):
          plgpu.wgmma(acc, p_smem, v_smem)
          plgpu.wgmma_wait(0)

        o = pl.run_state(pv)(plgpu.ACC.init(o * lax.broadcast_in_dim(alpha, o.shape, [0])))
        return o, m_new, l

      def logits(k_smem, cols):
        def qk(acc):
          plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
          plgpu.wgmma_wait(0)
          return acc[...]
        return pl.run_scoped(qk, plgpu.ACC((ROWS, cols), f32)) * scale

      plgpu.barrier_wait(bar_q)

      @pl.when(first)
      def _():
        plgpu.barrier_wait(bar_first)
        keep_rows(vb_smem, lambda r: r < t)
        if ns:
          keep_rows(sv_smem, lambda r: r < jnp.minimum(length, n_sink))

      @pl.when(jnp.logical_not(first))
      def _():  # the other programs' block and sink logits are masked; p v meets zeros
        zeros = jnp.zeros((BLOCK_ROWS, d), dtype)
        vb_smem[...] = zeros
        sv_smem[...] = zeros
        plgpu.commit_smem()

      # the block (program 0): query row r (token r % t) sees block rows
      # j <= r % t, so its real rows have a finite running max from here on
      s = logits(kb_smem, BLOCK_ROWS)
      row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
      col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where((col <= row % t) & first, s, -jnp.inf)
      o = plgpu.layout_cast(jnp.zeros((ROWS, d), f32), plgpu.Layout.WGMMA)
      m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, f32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((ROWS,), f32), plgpu.Layout.WGMMA.reduce(1))
      carry = update((o, m, l), s, pb_smem, vb_smem)
      if ns:
        s = logits(sk_smem, BLOCK_ROWS)
        col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((col < jnp.minimum(length, n_sink)) & first, s, -jnp.inf)
        carry = update(carry, s, pb_smem, sv_smem)
      for i in range(mine):
        tile = p + i * splits
        start = w0a + tile * WINDOW_TILE
        plgpu.barrier_wait(bar_tiles.at[i])

        def live(r, start=start, tile=tile):
          return (start + r >= w0) & (start + r < length) & (tile < n_tiles)

        keep_rows(vw_smem[i], live)
        s = logits(kw_smem[i], WINDOW_TILE)
        s = jnp.where(live(lax.broadcasted_iota(jnp.int32, s.shape, 1)), s, -jnp.inf)
        carry = update(carry, s, pw_smem, vw_smem[i])
      o, m, l = carry

      def store(o):
        """(program 0) the output rows, then the new k/v rows into the caches."""
        o_rows[...] = o.astype(dtype)
        plgpu.commit_smem()
        for gi in range(g):
          plgpu.copy_smem_to_gmem(o_rows.at[pl.ds(gi * t, t)],
                                  out_ref.at[pl.ds(b * t, t), pl.ds((h * g + gi) * d, d)])
        plgpu.barrier_wait(bar_rows)
        plgpu.copy_smem_to_gmem(kv_rows.at[0, pl.ds(0, t)], kc_ref.at[b, h, pl.ds(length, t)])
        plgpu.copy_smem_to_gmem(kv_rows.at[1, pl.ds(0, t)], vc_ref.at[b, h, pl.ds(length, t)])
        plgpu.wait_smem_to_gmem(0)

      if splits == 1:
        store(o / lax.broadcast_in_dim(l, o.shape, [0]))
        return
      partials_gmem, = partials
      sem = pl.get_global(plgpu.SemaphoreType.REGULAR((nb * hkv,))).at[b * hkv + h]

      @pl.when(jnp.logical_not(first))
      def _publish():  # the first qr rows: o, and m | l (each repeated over half the columns)
        col = lax.broadcasted_iota(jnp.int32, (ROWS, d), 1)
        part_smem[0] = o
        part_smem[1] = jnp.where(col < d // 2, lax.broadcast_in_dim(m, (ROWS, d), (0,)),
                                 lax.broadcast_in_dim(l, (ROWS, d), (0,)))
        plgpu.commit_smem()
        for j in range(2):
          plgpu.copy_smem_to_gmem(part_smem.at[j, pl.ds(0, qr)], partials_gmem.at[j, p - 1, b, h])
        plgpu.wait_smem_to_gmem(0)
        plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

      @pl.when(first)
      def _merge_and_store():
        plgpu.semaphore_wait(sem, splits - 1, memory_scope="gpu")
        col = lax.broadcasted_iota(jnp.int32, (ROWS, d), 1)
        o_tot = o
        m_tot = lax.broadcast_in_dim(m, (ROWS, d), (0,))
        l_tot = lax.broadcast_in_dim(l, (ROWS, d), (0,))
        for j in range(1, splits):
          for k in range(2):
            plgpu.copy_gmem_to_smem(partials_gmem.at[k, j - 1, b, h],
                                    part_smem.at[k, pl.ds(0, qr)], bar_parts)
          plgpu.barrier_wait(bar_parts)
          o_j = plgpu.load(part_smem.at[0], (), layout=plgpu.Layout.WGMMA)
          ml = plgpu.load(part_smem.at[1], (), layout=plgpu.Layout.WGMMA)
          m_j = lax.broadcast_in_dim(jnp.max(jnp.where(col < d // 2, ml, -jnp.inf), axis=1),
                                     (ROWS, d), (0,))
          l_j = lax.broadcast_in_dim(jnp.max(jnp.where(col < d // 2, -jnp.inf, ml), axis=1),
                                     (ROWS, d), (0,))
          m_new = jnp.maximum(m_tot, m_j)  # finite in the real rows: program 0 saw the block
          a, c = jnp.exp2(m_tot - m_new), jnp.exp2(m_j - m_new)
          o_tot, l_tot, m_tot = o_tot * a + o_j * c, l_tot * a + l_j * c, m_new
        store(o_tot / l_tot)

    rows_d = dict(transforms=tiled(d))  # tiles whose rows hold d elements
    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, d), dtype, **rows_d),  # q
        plgpu.SMEM((BLOCK_ROWS, d), dtype, **rows_d),  # block k
        plgpu.SMEM((BLOCK_ROWS, d), dtype, **rows_d),  # block v
        plgpu.SMEM((BLOCK_ROWS, d), dtype, **rows_d),  # sink k
        plgpu.SMEM((BLOCK_ROWS, d), dtype, **rows_d),  # sink v
        [plgpu.SMEM((WINDOW_TILE, d), dtype, **rows_d) for _ in range(mine)],
        [plgpu.SMEM((WINDOW_TILE, d), dtype, **rows_d) for _ in range(mine)],
        plgpu.SMEM((ROWS, BLOCK_ROWS), dtype, transforms=tiled(BLOCK_ROWS)),  # p: block, sink
        plgpu.SMEM((ROWS, WINDOW_TILE), dtype, transforms=tiled(WINDOW_TILE)),  # p: a window tile
        plgpu.SMEM((ROWS, d), dtype),  # output rows, untiled: T-row stores
        plgpu.SMEM((2, 8, d), dtype),  # the new k/v rows, untiled: T-row cache writes
        # a partial: o, m | l; unused at one split
        plgpu.SMEM((2, ROWS, d) if splits > 1 else (1, 8, d), f32, transforms=tiled(d, 4)),
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=2 + 2 * bool(ns)),  # block, sink (program 0)
        plgpu.Barrier(num_arrivals=2, num_barriers=mine),  # window tiles
        plgpu.Barrier(num_arrivals=2),  # the new k/v rows
        plgpu.Barrier(num_arrivals=2))  # a partial, merged

  outs = [jax.ShapeDtypeStruct((nb * t, g * hkv * d), dtype)]
  if splits > 1:  # the split programs' partials (o; m | l), for program 0's merge
    outs.append(jax.ShapeDtypeStruct((2, splits - 1, nb, hkv, qr, d), f32))
  mesh = plgpu.Mesh(grid=(nb, hkv, splits), grid_names=("b", "h", "s"))
  # the caches as refs: written in place (aliased in and out of the kernel)
  kc_ref, vc_ref = jax.new_ref(k_cache), jax.new_ref(v_cache)
  out, *_ = pl.kernel(
      body, out_type=outs, mesh=mesh,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="window_attention_rows",
  )(lengths.astype(jnp.int32), blocks, kc_ref, vc_ref)
  return out, kc_ref[...], vc_ref[...]
