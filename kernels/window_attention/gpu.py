"""Attention of a new block with its rows written in place, Pallas with
Triton lowering: one kernel for the attention of a draft layer-pass (the sink
and recent window of a streaming cache, `window_attention_gpu`) or of a
sparse verify layer (a list of context rows, `listed_attention_gpu`, behind
`kernels.sparse_verify.ops.sparse_verify_packed`).

Why Triton, which jax deprecates: the Mosaic GPU form of the window
attention (`mosaic_gpu.py`) made the draft's step 0.37 ms slower at 32k x 16
(kernels/NOTES.md, "The seam between two attentions"); the listed form is
not written for Mosaic GPU: its rows sit at arbitrary indices, so each
would be a TMA load of its own (TMA moves boxes, not gathers).

Grid (B, Hkv, splits).  Program (b, h, p), with L = lengths[b]:
  * loads, from the packed qkv [B, T, Hkv, G + 2, D] (the fused projection's
    output, passed once as its free [B, T * Hkv * (G + 2), D] view, so no
    slice of q, k or v is materialized before the call), the q rows of the G
    query heads of KV head h times the T tokens as the M rows of one tile
    (tile row r = t * G + g, padded to a power of two >= 16 for the
    tensor-core dots; input row (t * Hkv + h) * (G + 2) + g), and the T rows
    of k_new / v_new of head h (input rows (t * Hkv + h) * (G + 2) + G and
    that + 1);
  * applies RoPE in f32 in registers to q and k_new: x * cos + rot(x) * sin
    with rot(x) = [-x2, x1] read as a second, column-permuted load of the same
    rows (no in-register shuffle), cast back to the input dtype;
  * online softmax (f32, log2 units) over the T block rows first (from
    registers, causal: query t sees block rows 0..t; every row then has a
    finite running max, so later masked tiles need no empty-row guard), then
    the context tiles of ``block_w`` rows: the window's (the sink rows
    [0, min(n_sink, L)) as one masked tile of next_pow2(n_sink) rows, then
    the window rows [max(n_sink, L - n_window), L) at the dynamic start,
    masked past L; only the tiles the window fills are walked) or the index
    list's (block i of the list: one index load, then a row gather of K and
    of V, entries outside [0, L) masked).  With splits > 1 the block and the
    sink are program 0's, context tile i is program i % splits's, and each
    program stores its partial (o, m, l) for ``common.combine_partials``
    (one XLA fusion after the kernel): the tiles' latency chains run side by
    side instead of one after another.  With ``prefetch`` a program's first
    tile is loaded with the q rows and tile i + 1's loads are issued before
    tile i's math (the index -> gather chain overlaps the dots);
  * stores the output rows (or its partials), and (program 0) the roped k
    rows and the v rows into the caches at rows L + t (masked row stores).  The cache outputs alias the
    cache inputs (``input_output_aliases``): the update is in place when the
    caller's cache buffers are donated (inside one jit, when the old cache is
    dead), otherwise XLA copies the caches first.  The program never reads
    back a row it writes (its reads are rows < L), and programs write disjoint
    rows, so there is no ordering hazard.

Why Triton and not Mosaic GPU: a program handles G * T query rows, at most 16
for the draft models at T <= 2 (G = 7 for Qwen2.5-0.5B, 4 for Llama-3.2-1B),
with masked row loads/stores at a per-sequence dynamic offset.  Mosaic GPU's
tensor-core path is WGMMA, whose accumulator needs M a multiple of 64
(``jax.experimental.mosaic.gpu.wgmma`` raises otherwise), so 3/4 of every tile
would be padding (a verify layer's 35 rows at 7B, T = 5, would fill 64); its
row gather/scatter, which the index list and the cache writes need, lowers
to TMA ``tile::gather4`` (sm_100+, Blackwell, not Hopper) and takes no
predicate ("Gather/scatter TMA does not support predicates yet" in jax's
Mosaic GPU lowering).  Triton's masked pointer loads/stores and 16-row dots
fit the shape directly.

Measured on one H200 (jax 0.11.2, bf16, D 64, 16 sink + 496 window rows,
lengths 4k-8k; device time from a profiler trace of 16 chained calls): 6.2-7.3
us per call at the Qwen2.5-0.5B (14/2 heads) and Llama-3.2-1B (32/8) shapes,
batch 1 and 16, T 1 and 2, where the op-by-op path it replaces (RoPE fusions,
two scatters, sparse_verify) took 7.7-12 us of kernel time in the same harness
(26 and 79 us at batch 16, T 1).  The time is latency, not bytes: block + RoPE
+ stores ~2 us, the sink tile ~0.4 us, each 128-row window tile ~0.85 us (the
online-softmax chain of one program; 1008 window rows: 9.6 us, 2032: 16.4 us).
64-row tiles were slower (7.4 us), 256-row ones no faster; 8 warps, 4-5
stages, unmasked full tiles and peeling the first tile's loads did not help.
With one program per (b, h) only B * Hkv programs run (32 at batch 16);
one window tile per program (splits = 4 here) takes the kernel to 5.0 us per
call inside the 7B + 0.5B step at 32k x 16 (7.4 us with splits = 1 in the
same step), plus one merge fusion: the draft phase 4.11 -> 3.91 ms
(results/h200/README.md).  With an index list at a 7B verify layer (T = 5,
G = 7, K = 512, batch 16): 11.8 us per call in the step, where
sparse_verify alone took 12.2 us and the RoPE, scatter and concatenation
kernels it also replaces ~12 us.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common, gpu_common
from kernels.window_attention.reference import check_shapes


def qkv_row(t, h, c, Hkv: int, G: int):
  """Row of token t, KV head h, slot c (query head g < G, G: k, G + 1: v) in
  the [B, T * Hkv * (G + 2), D] view of the packed qkv."""
  return (t * Hkv + h) * (G + 2) + c


def _kernel(len_ref, *refs, T, G, Hq, Hkv, M, TB, D, S, n_sink, NS, n_window,
            K, BW, P, prefetch, unroll, scale_log2):
  listed = K > 0  # context rows from an index list (else the sink and window)
  if listed:
    idx_ref, *refs = refs
  qkv_ref, cos_ref, sin_ref, kc_ref, vc_ref, *out_refs = refs
  b = pl.program_id(0)
  h = pl.program_id(1)
  L = len_ref[b]
  if P == 1:
    out_ref, kc_out, vc_out = out_refs
    p, first = 0, True
  else:  # program p: its share of the context tiles; program 0 also the block and sink
    o_ref, m_ref, l_ref, kc_out, vc_out = out_refs
    p = pl.program_id(2)
    first = p == 0
  half = D // 2
  cols = jnp.arange(D, dtype=jnp.int32)
  lo = cols < half
  rcols = jnp.where(lo, cols + half, cols - half)  # column of rot(x)
  hcols = jnp.where(lo, cols, cols - half)  # column of cos / sin
  sign = jnp.where(lo, -1.0, 1.0).astype(jnp.float32)

  def load_rope_inputs(ref, rows, tok, ok):
    m2 = ok[:, None]
    x = plt.load(ref.at[b, rows[:, None], cols[None, :]], mask=m2, other=0.0)
    xr = plt.load(ref.at[b, rows[:, None], rcols[None, :]], mask=m2,
                  other=0.0)
    c = plt.load(cos_ref.at[b, tok[:, None], hcols[None, :]], mask=m2,
                 other=0.0)
    s = plt.load(sin_ref.at[b, tok[:, None], hcols[None, :]], mask=m2,
                 other=0.0)
    return x, xr, c, s

  def rope(x, xr, c, s):
    rot = sign[None, :] * xr.astype(jnp.float32)
    return (x.astype(jnp.float32) * c + rot * s).astype(x.dtype)

  def load_rows(pos):
    """K and V rows at cache positions pos (-1: no row, masked)."""
    ok = pos >= 0
    rows = jnp.where(ok, pos, 0)
    k = plt.load(kc_ref.at[b, h, rows[:, None], cols[None, :]],
                 mask=ok[:, None], other=0.0)
    v = plt.load(vc_ref.at[b, h, rows[:, None], cols[None, :]],
                 mask=ok[:, None], other=0.0)
    return pos, k, v

  def attend(carry, pos, k, v):
    o, m, l = carry
    s = gpu_common.dot(q, k, trans_b=True) * scale_log2
    s = jnp.where(pos[None, :] >= 0, s, -jnp.inf)
    return gpu_common.softmax_update(o, m, l, s, v, guard_empty=P > 1)

  # The q, block and sink loads are all issued before any math.  Masked
  # load rows point at row 0: in range, and a masked load yields `other`.
  t_r, row_ok, orow = gpu_common.packed_rows(M, G, T, Hq, h)
  g_r = jnp.arange(M, dtype=jnp.int32) % G
  tok_r = jnp.where(row_ok, t_r, 0)
  qrow = jnp.where(row_ok, qkv_row(tok_r, h, g_r, Hkv, G), 0)
  q_in = load_rope_inputs(qkv_ref, qrow, tok_r, row_ok)
  j = jnp.arange(TB, dtype=jnp.int32)
  blk_ok = (j < T) & first
  tok_j = jnp.where(blk_ok, j, 0)
  krow = jnp.where(blk_ok, qkv_row(tok_j, h, G, Hkv, G), 0)
  kn_in = load_rope_inputs(qkv_ref, krow, tok_j, blk_ok)
  vrow = jnp.where(blk_ok, krow + 1, 0)
  vn = plt.load(qkv_ref.at[b, vrow[:, None], cols[None, :]],
                mask=blk_ok[:, None], other=0.0)
  if n_sink:
    sink_pos = jnp.arange(NS, dtype=jnp.int32)
    sink = load_rows(jnp.where((sink_pos < jnp.minimum(L, n_sink)) & first,
                               sink_pos, -1))

  # The context tiles of this program: tile i is tile p + i * P of the
  # index list (listed) or of the window.
  if listed:
    n_tiles = pl.cdiv(K, BW)

    def tile_pos(i):
      e0 = (p + i * P) * BW
      e = e0 + jnp.arange(BW, dtype=jnp.int32)
      in_list = e < K
      if unroll:  # the start may be static: a block past K stays a masked load
        at = idx_ref.at[b, jnp.where(in_list, e, 0)]
      else:
        at = idx_ref.at[b, pl.ds(e0, BW)]
      ctx = plt.load(at, mask=in_list, other=-1)
      return jnp.where((ctx >= 0) & (ctx < L), ctx, -1)
  else:
    w0 = jnp.maximum(L - n_window, n_sink)
    n_tiles = pl.cdiv(jnp.maximum(L - w0, 0), BW) if n_window else 0

    def tile_pos(i):
      pos = w0 + (p + i * P) * BW + jnp.arange(BW, dtype=jnp.int32)
      return jnp.where(pos < L, pos, -1)
  if unroll:
    # Every tile this program can own, loaded before any math: the tile
    # count's static bound, tiles past its own all -1 (masked loads, no
    # traffic): the index loads first, then the row loads, so all of a
    # program's bytes are in flight at once.
    n_static = common.cdiv(common.cdiv(K if listed else n_window, BW), P)
    poss = [tile_pos(i) for i in range(n_static)]
    tiles = [load_rows(pos) for pos in poss]
  elif prefetch:  # the first tile's index and row loads go out with the q loads
    ahead = load_rows(tile_pos(0))

  q = rope(*q_in)  # [M, D]
  kn = rope(*kn_in)  # [TB, D]
  # The block first: query row r sees block rows j <= t_r (j = 0 at least),
  # so with one program every row has a finite running max from here on
  # (the split programs' rows may see no key: guarded updates).
  s = gpu_common.dot(q, kn, trans_b=True) * scale_log2
  s = jnp.where(blk_ok[None, :] & (j[None, :] <= t_r[:, None]), s, -jnp.inf)
  carry = gpu_common.softmax_update(*gpu_common.softmax_init(M, D), s, vn,
                                    guard_empty=P > 1)
  if n_sink:
    carry = attend(carry, *sink)
  if unroll:
    for tile in tiles:
      carry = attend(carry, *tile)
  else:
    mine = n_tiles if P == 1 else pl.cdiv(jnp.maximum(n_tiles - p, 0), P)
    if prefetch:
      # Tile i + 1's loads are issued before tile i's math, so its index ->
      # row-gather latency overlaps that math (past the last tile every row
      # is -1: masked loads, no traffic).
      def step(i, c):
        nxt = load_rows(tile_pos(i + 1))
        return attend(c[:3], *c[3:]) + nxt

      carry = lax.fori_loop(0, mine, step, carry + ahead)[:3]
    else:
      carry = lax.fori_loop(0, mine,
                            lambda i, c: attend(c, *load_rows(tile_pos(i))),
                            carry)

  o, m, l = carry
  if P == 1:
    plt.store(out_ref.at[b, orow[:, None], cols[None, :]],
              (o / l[:, None]).astype(out_ref.dtype), mask=row_ok[:, None])
  else:
    plt.store(o_ref.at[p, b, orow[:, None], cols[None, :]], o,
              mask=row_ok[:, None])
    plt.store(m_ref.at[p, b, orow], m, mask=row_ok)
    plt.store(l_ref.at[p, b, orow], l, mask=row_ok)
  # Masked rows point past the cache (row S), never at a live row: interpret
  # mode discharges a masked store as a scatter of old-or-new values, where
  # a duplicate row index would race with the real write (OOB is dropped).
  wrow = L + j
  w_ok = blk_ok & (wrow < S)
  wrow = jnp.where(w_ok, wrow, S)
  plt.store(kc_out.at[b, h, wrow[:, None], cols[None, :]],
            kn.astype(kc_out.dtype), mask=w_ok[:, None])
  plt.store(vc_out.at[b, h, wrow[:, None], cols[None, :]],
            vn.astype(vc_out.dtype), mask=w_ok[:, None])


# Programs per (sequence, KV head) at most: at 2032 window rows (16 tiles),
# 8 programs of two tiles each beat 16 of one by 2-6 us per call at batch 1,
# 8 and 16 on an H100 (results/h100/window_tuning): each program pays the q
# loads and RoPE, and the merge reads every program's partial.
MAX_SPLITS = 8


# A program loads all its window tiles before any math (`unroll`) when it
# owns at most this many: at 2032 rows (2 tiles a program) 12.2 against
# 12.7 us a call and 10.81 against 10.89 ms a step at 32k x 16 on an H100
# (results/h100/window_unroll); more tiles would hold more registers.
MAX_UNROLLED_TILES = 2


def default_tuning(n_window):
  """Window tiles of 128 rows (fewer when the window is shorter), at most
  MAX_SPLITS programs sharing them, 4 warps, 3 stages; a program's tiles
  all loaded at once when they are few, else each issued a tile ahead."""
  block_w = min(128, max(16, common.next_pow2(max(n_window, 1))))
  n_blocks = common.cdiv(n_window, block_w)
  splits = max(1, min(MAX_SPLITS, n_blocks))
  return dict(block_w=block_w, splits=splits, num_warps=4, num_stages=3,
              prefetch=True,
              unroll=common.cdiv(n_blocks, splits) <= MAX_UNROLLED_TILES)


def listed_tuning(B, Hkv, K):
  """Index blocks of 64 rows (row gathers, as sparse_verify), about two
  programs per SM over the grid (B, Hkv, splits), 4 warps, 3 stages, loads
  issued ahead."""
  block_w = 64
  splits = round(2 * common.num_sms() / (B * Hkv))
  return dict(block_w=block_w,
              splits=max(1, min(splits, common.cdiv(K, block_w))),
              num_warps=4, num_stages=3, prefetch=True, unroll=False)


def window_attention_gpu(qkv, k_cache, v_cache, lengths, cos, sin, *, n_sink,
                         n_window, scale=None, interpret=False, **tuning):
  check_shapes(qkv, k_cache, v_cache, lengths, cos, sin, n_sink, n_window)
  return _call(qkv, k_cache, v_cache, lengths, cos, sin, None, int(n_sink),
               int(n_window), scale, interpret, default_tuning(int(n_window)),
               tuning)


def listed_attention_gpu(qkv, k_cache, v_cache, lengths, cos, sin, indices, *,
                         scale=None, interpret=False, **tuning):
  """The kernel with the context rows named by `indices` [B, K] (each <
  lengths[b]; -1 or out of range: none) instead of the sink and window."""
  B, _, _, _, Hkv, _ = common.check_packed_shapes(qkv, k_cache, v_cache,
                                                  lengths, cos, sin)
  if indices.ndim != 2 or indices.shape[0] != B or indices.shape[1] < 1:
    raise ValueError(f"indices must be int32[B={B}, K >= 1], got {indices.shape}")
  return _call(qkv, k_cache, v_cache, lengths, cos, sin, indices, 0, 0, scale,
               interpret, listed_tuning(B, Hkv, indices.shape[1]), tuning)


def _call(qkv, k_cache, v_cache, lengths, cos, sin, indices, n_sink, n_window,
          scale, interpret, defaults, tuning):
  """The pallas_call; `tuning` overrides `defaults` where it is not None."""
  unknown = sorted(tuning.keys() - defaults.keys())
  if unknown:
    raise ValueError(f"unknown tuning {unknown}; known: {sorted(defaults)}")
  tune = defaults | {k: v for k, v in tuning.items() if v is not None}
  block_w, splits, prefetch = tune["block_w"], tune["splits"], tune["prefetch"]
  B, T, Hkv, G2, D = qkv.shape
  S = k_cache.shape[2]
  G = G2 - 2
  Hq = G * Hkv
  P = max(1, int(splits))
  if D & (D - 1) or D < 16:
    raise ValueError(f"head_dim={D} must be a power of two >= 16 (Triton)")
  if block_w & (block_w - 1) or block_w < 16:
    raise ValueError(f"block_w={block_w} must be a power of two >= 16")
  M = max(16, common.next_pow2(G * T))
  TB = max(16, common.next_pow2(T))
  NS = max(16, common.next_pow2(n_sink))
  scale = common.default_scale(D, scale)
  K = 0 if indices is None else indices.shape[1]
  kernel = functools.partial(
      _kernel, T=T, G=G, Hq=Hq, Hkv=Hkv, M=M, TB=TB, D=D, S=S, n_sink=n_sink,
      NS=NS, n_window=n_window, K=K, BW=block_w, P=P, prefetch=bool(prefetch),
      unroll=bool(tune["unroll"]), scale_log2=scale * common.LOG2E)
  if P == 1:
    outs = [jax.ShapeDtypeStruct((B, T * Hq, D), qkv.dtype)]
  else:  # partial softmax results (kernels.common), merged below
    outs = [jax.ShapeDtypeStruct((P, B, T * Hq, D), jnp.float32),
            jax.ShapeDtypeStruct((P, B, T * Hq), jnp.float32),
            jax.ShapeDtypeStruct((P, B, T * Hq), jnp.float32)]
  args = [lengths.astype(jnp.int32)]
  if indices is not None:
    args.append(indices.astype(jnp.int32))
  args += [qkv.reshape(B, T * Hkv * G2, D), cos.astype(jnp.float32),
           sin.astype(jnp.float32), k_cache, v_cache]
  *out, k_cache, v_cache = pl.pallas_call(
      kernel,
      grid=(B, Hkv) if P == 1 else (B, Hkv, P),
      out_shape=outs + [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={len(args) - 2: len(outs), len(args) - 1: len(outs) + 1},
      compiler_params=plt.CompilerParams(num_warps=tune["num_warps"],
                                         num_stages=tune["num_stages"]),
      interpret=interpret,
      name="window_attention" if indices is None else "listed_attention",
  )(*args)
  out = out[0] if P == 1 else common.combine_partials(*out, qkv.dtype)
  return out.reshape(B, T, Hq, D), k_cache, v_cache
