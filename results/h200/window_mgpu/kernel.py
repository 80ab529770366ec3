"""Probe kernel, not part of the package: a streaming draft's sink + window
attention for Hopper in Mosaic GPU, in the layouts the seam pass could feed
and read without XLA kernels between (see ../window_mgpu/README.md).

One program per (sequence b, KV head h), one warpgroup, every load issued
at the start (the block's k/v, the sink and all window tiles: ~140 KB of
shared memory at a 512-row window), then an online softmax over the block,
the sink and the window tiles as they land. No split, so no merge after.

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
this kernel has no interpret path; `reference` is the oracle on the GPU.
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


@functools.partial(jax.jit, static_argnames=("g", "t", "n_sink", "n_window", "block_w"),
                   donate_argnames=("k_cache", "v_cache"))
def window_attention_heads(q, kv_new, k_cache, v_cache, lengths, *, g: int, t: int, n_sink: int,
                           n_window: int, block_w: int = 128):
  """Returns (out [Hq, B * T, D], k_cache, v_cache); see the module docstring."""
  nb, hkv, qr, d = q.shape
  n_tiles = -(-(n_window + 7) // block_w)
  ns = TB if n_sink else 0
  assert n_sink <= TB and qr <= ROWS and t <= 8 and d == 64  # D 128 would not fit shared memory
  scale = LOG2E / d ** 0.5
  dtype = q.dtype

  def body(len_ref, q_ref, kvn_ref, kc_in, vc_in, out_ref, kc_ref, vc_ref):
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    b = pl.program_id(0)
    h = pl.program_id(1)
    length = len_ref[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8  # a provable multiple of 8: TMA into a tiled tile

    def scope(q_smem, kb_smem, vb_smem, sk_smem, sv_smem, kw_smem, vw_smem, pb_smem, pw_smem,
              o_plain, kv_plain, bar_first, bar_tiles, bar_plain):
      plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, qr)], bar_first)
      plgpu.copy_gmem_to_smem(kvn_ref.at[0, b, h], kb_smem, bar_first)
      plgpu.copy_gmem_to_smem(kvn_ref.at[1, b, h], vb_smem, bar_first)
      if ns:
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, pl.ds(0, ns)], sk_smem, bar_first)
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, pl.ds(0, ns)], sv_smem, bar_first)
      for i in range(n_tiles):  # rows past S read as zeros (TMA), rows past L are masked
        rows = pl.ds(w0a + i * block_w, block_w)
        plgpu.copy_gmem_to_smem(kc_ref.at[b, h, rows], kw_smem[i], bar_tiles.at[i])
        plgpu.copy_gmem_to_smem(vc_ref.at[b, h, rows], vw_smem[i], bar_tiles.at[i])
      plgpu.copy_gmem_to_smem(kvn_ref.at[:, b, h, pl.ds(0, 8)], kv_plain, bar_plain)

      def update(carry, s, p_smem, v_smem):
        o, m, l = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + jnp.sum(p, axis=1)
        p_smem[...] = p.astype(dtype)
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
        return pl.run_scoped(qk, plgpu.ACC((ROWS, cols), jnp.float32)) * scale

      plgpu.barrier_wait(bar_first)
      # the block: query row r (token r % t) sees block rows j <= r % t, so
      # every real row has a finite running max from here on
      s = logits(kb_smem, TB)
      row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
      col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(col <= row % t, s, -jnp.inf)
      o = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
      m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      carry = update((o, m, l), s, pb_smem, vb_smem)
      if ns:
        s = logits(sk_smem, ns)
        col = lax.broadcasted_iota(jnp.int32, (ROWS, ns), 1)
        s = jnp.where(col < jnp.minimum(length, n_sink), s, -jnp.inf)
        carry = update(carry, s, pb_smem, sv_smem)
      for i in range(n_tiles):  # a tile wholly past L adds exp2(-inf) = 0
        plgpu.barrier_wait(bar_tiles.at[i])
        s = logits(kw_smem[i], block_w)
        pos = w0a + i * block_w + lax.broadcasted_iota(jnp.int32, (ROWS, block_w), 1)
        s = jnp.where((pos >= w0) & (pos < length), s, -jnp.inf)
        carry = update(carry, s, pw_smem, vw_smem[i])
      o, m, l = carry
      o_plain[...] = (o / lax.broadcast_in_dim(l, o.shape, [0])).astype(dtype)
      plgpu.commit_smem()
      for gi in range(g):
        plgpu.copy_smem_to_gmem(o_plain.at[pl.ds(gi * t, t)],
                                out_ref.at[h * g + gi, pl.ds(b * t, t)])
      plgpu.barrier_wait(bar_plain)
      plgpu.copy_smem_to_gmem(kv_plain.at[0, pl.ds(0, t)], kc_ref.at[b, h, pl.ds(length, t)])
      plgpu.copy_smem_to_gmem(kv_plain.at[1, pl.ds(0, t)], vc_ref.at[b, h, pl.ds(length, t)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scope,
        plgpu.SMEM((ROWS, d), dtype, transforms=_tiled(d)),  # q
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # block k
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # block v
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # sink k
        plgpu.SMEM((TB, d), dtype, transforms=_tiled(d)),  # sink v
        [plgpu.SMEM((block_w, d), dtype, transforms=_tiled(d)) for _ in range(n_tiles)],
        [plgpu.SMEM((block_w, d), dtype, transforms=_tiled(d)) for _ in range(n_tiles)],
        plgpu.SMEM((ROWS, TB), dtype, transforms=_tiled(TB)),  # p of the block / sink
        plgpu.SMEM((ROWS, block_w), dtype, transforms=_tiled(block_w)),  # p of a window tile
        plgpu.SMEM((ROWS, d), dtype),  # the output, untiled: T-row stores
        plgpu.SMEM((2, 8, d), dtype),  # the new k/v rows, untiled: T-row cache writes
        plgpu.Barrier(num_arrivals=3 + 2 * bool(ns)),
        plgpu.Barrier(num_arrivals=2, num_barriers=n_tiles),
        plgpu.Barrier(num_arrivals=1))

  gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
  return pl.pallas_call(
      body, grid=(nb, hkv), in_specs=[gmem] * 5, out_specs=[gmem] * 3,
      out_shape=[jax.ShapeDtypeStruct((g * hkv, nb * t, d), dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={3: 1, 4: 2},
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      name="window_attention_heads",
  )(lengths.astype(jnp.int32), q, kv_new, k_cache, v_cache)


def tiled_reference(q, kv_new, k_cache, v_cache, lengths, *, g, t, n_sink, n_window,
                    block_w=128):
  """The kernel's tiles and masks in jnp (f32 logits, p rounded as the
  kernel rounds it): checks `pack_inputs` and the masks on the CPU."""
  nb, hkv, qr, d = q.shape
  n_tiles = -(-(n_window + 7) // block_w)
  scale = LOG2E / d ** 0.5
  f32 = jnp.float32
  outs = []
  for b in range(nb):
    length = lengths[b]
    w0 = jnp.maximum(length - n_window, n_sink)
    w0a = (w0 // 8) * 8
    rows = w0a + jnp.arange(n_tiles * block_w)
    heads = []
    for h in range(hkv):
      qb = q[b, h].astype(f32)
      kb, vb = kv_new[0, b, h, :t].astype(f32), kv_new[1, b, h, :t].astype(f32)
      r = jnp.arange(qr)
      s_blk = jnp.where(jnp.arange(t)[None] <= (r % t)[:, None], qb @ kb.T * scale, -jnp.inf)
      ks, vs = k_cache[b, h, :TB].astype(f32), v_cache[b, h, :TB].astype(f32)
      s_sink = jnp.where(jnp.arange(TB)[None] < jnp.minimum(length, n_sink), qb @ ks.T * scale,
                         -jnp.inf)
      kw = jnp.take(k_cache[b, h], jnp.clip(rows, 0, k_cache.shape[2] - 1), axis=0).astype(f32)
      vw = jnp.take(v_cache[b, h], jnp.clip(rows, 0, k_cache.shape[2] - 1), axis=0).astype(f32)
      ok = (rows >= w0) & (rows < length)
      s_win = jnp.where(ok[None], qb @ kw.T * scale, -jnp.inf)
      s = jnp.concatenate([s_blk, s_sink, s_win], 1)
      m = jnp.max(s, axis=1, keepdims=True)
      p = jnp.exp2(s - m)
      o = p.astype(q.dtype).astype(f32) @ jnp.concatenate([vb, vs, vw]) / p.sum(1, keepdims=True)
      heads.append(o[:g * t].reshape(g, t, d))
    outs.append(jnp.concatenate(heads))  # [Hq, T, D]
  return jnp.stack(outs, 1).reshape(g * hkv, nb * t, d).astype(q.dtype)
