"""Probe kernel, not part of the package: a streaming draft's sink + window
attention for Hopper in Mosaic GPU, in the layouts the seam pass could feed
and read without XLA kernels between (see ../window_mgpu/README.md).

`splits` programs per (sequence b, KV head h), one warpgroup each, every
load issued at the start (program 0: the block's k/v and the sink; each
program: its window tiles), then an online softmax over them as they
land. At one split a program walks all four window tiles from shared
memory (~210 KB) and nothing is merged; at four, one tile each, and program
0 merges the others' partials (a GMEM semaphore) with no XLA kernel after.

Inputs (built by `pack_inputs`, which the seam pass's row-scale/bias XLA
fusion would also do):
  q      [B, Hkv, QR, D]  roped queries, row g * T + t (QR = G*T rounded up to 8)
  kv_new [2, B, Hkv, 64, D]  roped k rows / v rows of the T new tokens, rows >= T zero
  k_cache, v_cache [B, Hkv, S, D]  rows L .. L + T - 1 written (aliased)
Output: out [Hq, B * T, D] (head-major: the seam kernel's attention tiles).

Mosaic GPU constraints met (jax 0.10.2 lowering, checked on the CPU): a TMA
into a tiled (swizzled) shared-memory tile needs a GMEM row start the
compiler can prove a multiple of 8, so window tiles start at
(w0 // 8) * 8 and mask the rows before w0; the T-row cache writes and the
head-major output rows go through untiled shared memory. Interpret mode
(jax 0.10.2) has no transposed WGMMA operand and no register operand, so
this kernel has no interpret path: on the GPU `probe.py` compares it with
the package's reference, on the CPU `tiled_reference` checks its arithmetic.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # WGMMA's row operand
TB = 64  # block rows (the new tokens' k/v) and sink rows: narrower WGMMA tiles fail layout inference
LOG2E = 1.4426950408889634


def _tiled(cols: int, itemsize: int = 2):
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def pack_inputs(qkv, cos, sin):
  """qkv [B, T, Hkv, G + 2, D] before RoPE (the decoder's packed layout),
  cos/sin [B, T, D // 2] -> (q [B, Hkv, QR, D], kv_new [2, B, Hkv, TB, D])."""
  b, t, hkv, g2, d = qkv.shape
  g = g2 - 2
  f32 = jnp.float32
  c = jnp.concatenate([cos, cos], -1)[:, :, None, None].astype(f32)
  s = jnp.concatenate([sin, sin], -1)[:, :, None, None].astype(f32)
  x = qkv[..., :g + 1, :].astype(f32)
  rot = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  roped = (x * c + rot * s).astype(qkv.dtype)
  q = roped[..., :g, :].transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
  qr = -(-g * t // 8) * 8
  q = jnp.pad(q, ((0, 0), (0, 0), (0, qr - g * t), (0, 0)))
  k = roped[..., g, :].transpose(0, 2, 1, 3)
  v = qkv[..., g + 1, :].transpose(0, 2, 1, 3)
  kv = jnp.stack([k, v])
  return q, jnp.pad(kv, ((0, 0), (0, 0), (0, 0), (0, TB - t), (0, 0)))


@functools.partial(jax.jit, static_argnames=("g", "t", "n_sink", "n_window", "block_w", "splits"),
                   donate_argnames=("k_cache", "v_cache"))
def window_attention_heads(q, kv_new, k_cache, v_cache, lengths, *, g: int, t: int, n_sink: int,
                           n_window: int, block_w: int = 128, splits: int = 1):
  """Returns (out [Hq, B * T, D], k_cache, v_cache); see the module docstring.

  `splits` programs per (b, h): program p walks window tiles p, p + splits,
  ...; program 0 also the block and the sink, and it merges the others'
  partial (o, m, l) after waiting on a GMEM semaphore each of them signals
  (all programs must be resident at once: B * Hkv * splits <= the SMs)."""
  nb, hkv, qr, d = q.shape
  n_tiles = -(-(n_window + 7) // block_w)
  mine = -(-n_tiles // splits)  # window tiles a program walks
  ns = TB if n_sink else 0
  assert n_sink <= TB and qr <= ROWS and t <= 8 and d == 64  # D 128 would not fit shared memory
  assert 1 <= splits <= n_tiles
  scale = LOG2E / d ** 0.5
  dtype = q.dtype
  f32 = jnp.float32

  def body(len_ref, q_ref, kvn_ref, kc_in, vc_in, out_ref, kc_ref, vc_ref, *partials):
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    b = pl.program_id(0)
    h = pl.program_id(1)
    p = pl.program_id(2)
    length = len_ref[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8  # a provable multiple of 8: TMA into a tiled tile
    first = p == 0

    def scope(q_smem, kb_smem, vb_smem, sk_smem, sv_smem, kw_smem, vw_smem, pb_smem, pw_smem,
              o_plain, kv_plain, part_smem, bar_q, bar_first, bar_tiles, bar_plain, bar_parts):
      plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, qr)], bar_q)

      @pl.when(first)
      def _block_and_sink():
        plgpu.copy_gmem_to_smem(kvn_ref.at[0, b, h], kb_smem, bar_first)
        plgpu.copy_gmem_to_smem(kvn_ref.at[1, b, h], vb_smem, bar_first)
        if ns:
          plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pl.ds(0, ns)], sk_smem, bar_first)
          plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pl.ds(0, ns)], sv_smem, bar_first)
        plgpu.copy_gmem_to_smem(kvn_ref.at[:, b, h, pl.ds(0, 8)], kv_plain, bar_plain)

      for i in range(mine):  # rows past S read as zeros (TMA), rows past L are masked
        rows = pl.ds(w0a + (p + i * splits) * block_w, block_w)
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, rows], kw_smem[i], bar_tiles.at[i])
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, rows], vw_smem[i], bar_tiles.at[i])

      @pl.when(jnp.logical_not(first))
      def _no_block():  # their logits are masked; p v must not meet stale NaNs
        zeros = jnp.zeros((TB, d), dtype)
        vb_smem[...] = zeros
        sv_smem[...] = zeros
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

      # the block (program 0): query row r (token r % t) sees block rows
      # j <= r % t, so its real rows have a finite running max from here on
      s = logits(kb_smem, TB)
      row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
      col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where((col <= row % t) & first, s, -jnp.inf)
      o = plgpu.layout_cast(jnp.zeros((ROWS, d), f32), plgpu.Layout.WGMMA)
      m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, f32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((ROWS,), f32), plgpu.Layout.WGMMA.reduce(1))
      carry = update((o, m, l), s, pb_smem, vb_smem)
      if ns:
        s = logits(sk_smem, ns)
        col = lax.broadcasted_iota(jnp.int32, (ROWS, ns), 1)
        s = jnp.where((col < jnp.minimum(length, n_sink)) & first, s, -jnp.inf)
        carry = update(carry, s, pb_smem, sv_smem)
      for i in range(mine):  # a tile wholly past L (or past the window) adds nothing
        plgpu.barrier_wait(bar_tiles.at[i])
        s = logits(kw_smem[i], block_w)
        tile = p + i * splits
        pos = w0a + tile * block_w + lax.broadcasted_iota(jnp.int32, (ROWS, block_w), 1)
        s = jnp.where((pos >= w0) & (pos < length) & (tile < n_tiles), s, -jnp.inf)
        carry = update(carry, s, pw_smem, vw_smem[i])
      o, m, l = carry

      def store(o):
        """(program 0) the output rows, then the new k/v rows into the caches."""
        o_plain[...] = o.astype(dtype)
        plgpu.commit_smem()
        for gi in range(g):
          plgpu.copy_smem_to_gmem(o_plain.at[pl.ds(gi * t, t)],
                                  out_ref.at[h * g + gi, pl.ds(b * t, t)])
        plgpu.barrier_wait(bar_plain)
        plgpu.copy_smem_to_gmem(kv_plain.at[0, pl.ds(0, t)], kc_ref.at[b, h, pl.ds(length, t)])
        plgpu.copy_smem_to_gmem(kv_plain.at[1, pl.ds(0, t)], vc_ref.at[b, h, pl.ds(length, t)])
        plgpu.wait_smem_to_gmem(0)

      if splits > 1:
        o_part, ml_part = partials
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((nb * hkv,))).at[b * hkv + h]

        @pl.when(jnp.logical_not(first))
        def _publish():  # o, and m, l repeated along 64 columns (WGMMA-shaped loads)
          part_smem[0] = o
          part_smem[1] = lax.broadcast_in_dim(m, (ROWS, d), (0,))
          part_smem[2] = lax.broadcast_in_dim(l, (ROWS, d), (0,))
          plgpu.commit_smem()
          for j in range(3):
            src = part_smem.at[j]
            dst = o_part.at[p - 1, b, h] if j == 0 else ml_part.at[j - 1, p - 1, b, h]
            plgpu.copy_smem_to_gmem(src, dst)
          plgpu.wait_smem_to_gmem(0)
          plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

        @pl.when(first)
        def _merge_and_store():
          plgpu.semaphore_wait(sem, splits - 1, memory_scope="gpu")
          o_tot = o
          m_tot = lax.broadcast_in_dim(m, (ROWS, d), (0,))
          l_tot = lax.broadcast_in_dim(l, (ROWS, d), (0,))
          for j in range(1, splits):
            plgpu.copy_gmem_to_smem(o_part.at[j - 1, b, h], part_smem.at[0], bar_parts)
            plgpu.copy_gmem_to_smem(ml_part.at[0, j - 1, b, h], part_smem.at[1], bar_parts)
            plgpu.copy_gmem_to_smem(ml_part.at[1, j - 1, b, h], part_smem.at[2], bar_parts)
            plgpu.barrier_wait(bar_parts)
            o_j = plgpu.load(part_smem.at[0], (), layout=plgpu.Layout.WGMMA)
            m_j = plgpu.load(part_smem.at[1], (), layout=plgpu.Layout.WGMMA)
            l_j = plgpu.load(part_smem.at[2], (), layout=plgpu.Layout.WGMMA)
            m_new = jnp.maximum(m_tot, m_j)  # finite: program 0 saw the block
            a, c = jnp.exp2(m_tot - m_new), jnp.exp2(m_j - m_new)
            o_tot, l_tot, m_tot = o_tot * a + o_j * c, l_tot * a + l_j * c, m_new
          store(o_tot / l_tot)
      else:
        store(o / lax.broadcast_in_dim(l, o.shape, [0]))

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, d), dtype, transforms=_tiled(d)),  # q
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # block k
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # block v
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # sink k
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # sink v
        [plgpu.SMEM((block_w, d), dtype, transforms=_tiled(d)) for _ in range(mine)],
        [plgpu.SMEM((block_w, d), dtype, transforms=_tiled(d)) for _ in range(mine)],
        plgpu.SMEM((ROWS, TB), dtype, transforms=_tiled(TB)),  # p of the block / sink
        plgpu.SMEM((ROWS, block_w), dtype, transforms=_tiled(block_w)),  # p of a window tile
        plgpu.SMEM((ROWS, d), dtype),  # the output, untiled: T-row stores
        plgpu.SMEM((2, 8, d), dtype),  # the new k/v rows, untiled: T-row cache writes
        # a partial (o, m, l) (unused at one split)
        plgpu.SMEM((3, ROWS, d) if splits > 1 else (1, 8, d), f32, transforms=_tiled(d, 4)),
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=2 + 2 * bool(ns)),  # block, sink (program 0)
        plgpu.Barrier(num_arrivals=2, num_barriers=mine),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=3))

  gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
  outs = [jax.ShapeDtypeStruct((g * hkv, nb * t, d), dtype),
          jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
          jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
  if splits > 1:  # the split programs' partials, for program 0's merge
    outs += [jax.ShapeDtypeStruct((splits - 1, nb, hkv, ROWS, d), f32),
             jax.ShapeDtypeStruct((2, splits - 1, nb, hkv, ROWS, d), f32)]
  out, k_cache, v_cache, *_ = pl.pallas_call(
      body, grid=(nb, hkv, splits), in_specs=[gmem] * 5, out_specs=[gmem] * len(outs),
      out_shape=outs, input_output_aliases={3: 1, 4: 2},
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="window_attention_heads",
  )(lengths.astype(jnp.int32), q, kv_new, k_cache, v_cache)
  return out, k_cache, v_cache


def tiled_reference(q, kv_new, k_cache, v_cache, lengths, *, g, t, n_sink, n_window,
                    block_w=128, splits=1):
  """The kernel's tiles, masks, guarded online softmax and merge of split
  partials in jnp (f32 logits, p rounded as the kernel rounds it): checks
  `pack_inputs` and that arithmetic on the CPU."""
  nb, hkv, qr, d = q.shape
  n_tiles = -(-(n_window + 7) // block_w)
  mine = -(-n_tiles // splits)
  scale = LOG2E / d ** 0.5
  f32 = jnp.float32
  s_len = k_cache.shape[2]

  def update(carry, s, v):
    o, m, l = carry
    m_new = jnp.maximum(m, s.max(1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    return (o * alpha[:, None] + p.astype(q.dtype).astype(f32) @ v, m_new,
            l * alpha + p.sum(1))

  outs = []
  for b in range(nb):
    length = lengths[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8
    heads = []
    for h in range(hkv):
      qb = q[b, h].astype(f32)
      r = jnp.arange(qr)
      parts = []
      for p in range(splits):
        carry = (jnp.zeros((qr, d), f32), jnp.full((qr,), -jnp.inf, f32), jnp.zeros((qr,), f32))
        if p == 0:
          kb, vb = kv_new[0, b, h].astype(f32), kv_new[1, b, h].astype(f32)
          s = jnp.where(jnp.arange(TB)[None] <= (r % t)[:, None], qb @ kb.T * scale, -jnp.inf)
          carry = update(carry, s, vb)
          ks, vs = k_cache[b, h, :TB].astype(f32), v_cache[b, h, :TB].astype(f32)
          s = jnp.where(jnp.arange(TB)[None] < jnp.minimum(length, n_sink), qb @ ks.T * scale,
                        -jnp.inf)
          carry = update(carry, s, vs)
        for i in range(mine):
          tile = p + i * splits
          rows = w0a + tile * block_w + jnp.arange(block_w)
          kw = jnp.where((rows < s_len)[:, None], jnp.take(k_cache[b, h], jnp.clip(rows, 0, s_len - 1), axis=0), 0).astype(f32)
          vw = jnp.where((rows < s_len)[:, None], jnp.take(v_cache[b, h], jnp.clip(rows, 0, s_len - 1), axis=0), 0).astype(f32)
          ok = (rows >= w0) & (rows < length) & (tile < n_tiles)
          carry = update(carry, jnp.where(ok[None], qb @ kw.T * scale, -jnp.inf), vw)
        parts.append(carry)
      o, m, l = parts[0]
      for o_j, m_j, l_j in parts[1:]:
        m_new = jnp.maximum(m, m_j)
        a, c = jnp.exp2(m - m_new), jnp.exp2(m_j - m_new)
        o, l, m = o * a[:, None] + o_j * c[:, None], l * a + l_j * c, m_new
      o = o / l[:, None]
      heads.append(o[:g * t].reshape(g, t, d))
    outs.append(jnp.concatenate(heads))  # [Hq, T, D]
  return jnp.stack(outs, 1).reshape(g * hkv, nb * t, d).astype(q.dtype)
