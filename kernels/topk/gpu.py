"""Exact top-k of each row, Pallas with Triton lowering: a radix search for
the k-th largest key, then one compaction walk that writes the selected
(value, index) pairs in ascending index order.  The result is the reference's
bit for bit (``kernels.topk.reference``: lax.top_k's set, ties to the lower
index).

Every float is compared through ``sortable_key`` (an int32 whose signed order
is the float's total order).  Grid (B, P): program (b, p) owns the segment
[p * L, p * L + L) of row b (P = 1, L = S: the whole row), walked in blocks
of ``block`` keys (masked loads past the segment; those padding lanes get
the key INT32_MIN, the smallest, and come after every real lane; a segment
of one block is loaded once and held in registers by every walk), and:
  * radix search: the bucket [lo, lo + 2^s) (unsigned order of the keys,
    starting as all 2^32 keys) always holds the k-th largest key, with
    c_lo = #(key >= lo) >= k and c_hi = #(key >= lo + 2^s) < k.  A pass cuts
    the bucket into 2^bits candidate thresholds t_j = lo + j 2^s' (s' = s -
    bits), counts #(key >= t_j) for all of them in one walk (a [block, 2^bits]
    comparison summed over the block) and keeps the largest t_j whose count is
    still >= k (the counts fall with j, so that is the number of counts >= k,
    minus one); the first count below k is the new c_hi.  The search stops
    when s = 0 (lo is the k-th largest key: tau) or as soon as c_lo == k (the
    bucket holds exactly the k - c_hi missing entries: random normal
    scores stop after 4-6 of the 8 passes of 4 bits);
  * compaction: one more walk takes every key above the bucket (c_hi of them)
    and the first k - c_hi keys inside it in index order (a running count of
    the bucket keys seen, plus their in-block prefix count by ``cumsum``), and
    scatters value and index to output slot (#taken before it) with a masked
    store (the in-block prefix count again).

Why it is exact, ties included: lo only moves to a threshold with count >= k
and the bucket's upper end only to one with count < k, so when the search
ends the bucket holds the k-th largest key and exactly k - c_hi of the
selected entries are in it.  With s = 0 the bucket is the single key tau and
those are the first k - c_hi entries equal to tau by index, which is
lax.top_k's tie rule; when c_lo == k every bucket key is taken, whatever the
ties inside it.  No float is ever compared as a float: -0.0 < +0.0 and NaNs
order by their bits, as the reference.

Rows longer than a few chunks run in several calls of this kernel
(``chunk``): first P programs per row, each the top-k of its chunk of L
positions, giving P * k candidates per row in ascending index order; then,
while P >= 2 * ``group``, a call whose programs each take the top-k of
``group`` consecutive segments of candidates (P / group programs per row,
so each walks group * k candidates instead of one program walking P * k);
then one program per row over what is left.  A call over candidates loads
its output index from the candidates' index array at the selected slots.
Exact: an entry of the row's top-k is beaten (larger key, or equal key and
lower index) by fewer than k entries of the row, so by fewer than k of any
chunk or group that holds it, so it survives every call; and candidate
order is index order, so every call's ties still go to the lower index.  A
last chunk shorter than k fills its slots with padding lanes (index >= S,
a value whose key is INT32_MIN), which no later call takes where it has to
choose (each of its segments holds >= k lanes, and real candidates beat the
padding: same or larger key, lower slot).

Why Triton and not Mosaic GPU: the output is a scatter of k entries to data-
dependent positions, one masked store per block of keys, and the row is
walked as a pointer loop with a data-dependent number of passes.  Mosaic GPU
on Hopper has no masked store to arbitrary positions (its scatter is TMA
``tile::gather4``/scatter4 on sm_100+, without predicates), and its memory
path is TMA copies of whole tiles into shared memory, where this kernel
needs only a masked vector load per block from L2 (one row is 139 KB at
32k context and stays in L2 between the passes).  Triton's masked pointer
loads/stores and ``tt.scan`` (cumsum) fit directly.

On an H200 (B = 16, S = 34816, one call each): k = 128 / 304 / 512 in
22.2 / 28.7 / 30.7 us at the default tuning (the last in groups), where
lax.top_k (a full sort of each row) takes 177-180 us and the two-stage
lax.top_k of ``kernels.srh_scores.ops.select_topk`` 68.8 / 97.3 / 110.5 us.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import common
from kernels.topk.reference import check_topk_args, sortable_key

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def _kernel(x_ref, *refs, k, N, L, P, BLK, bits, from_candidates):
  if from_candidates:  # the second call: output index = the candidate's index
    cand_idx_ref, val_ref, idx_ref = refs
  else:
    val_ref, idx_ref = refs
  b = pl.program_id(0)
  p = pl.program_id(1)
  start = p * L
  end = jnp.minimum(start + L, N)
  n_blocks = common.cdiv(L, BLK)
  lanes = jnp.arange(BLK, dtype=jnp.int32)

  def load_block(i):
    """Values, positions, keys and validity of block i of the segment; lanes
    past it get the key INT32_MIN (the smallest)."""
    pos = start + i * BLK + lanes
    valid = pos < end
    x = plt.load(x_ref.at[b, pl.ds(start + i * BLK, BLK)], mask=valid,
                 other=-jnp.inf)
    key = jnp.where(valid, sortable_key(x), INT32_MIN)
    return x, pos, key, valid

  if n_blocks == 1:
    # The whole segment in one block: loaded once, held in registers by
    # every pass and the compaction, instead of re-read from L1/L2 by each.
    resident = load_block(0)
    load_block = lambda i: resident

  C = 1 << bits
  digit = jnp.arange(C, dtype=jnp.int32)

  def count_at_least(thresholds):
    """#(key >= t) over the segment for each of the C thresholds."""
    def body(i, counts):
      key = load_block(i)[2]
      ge = key[:, None] >= thresholds[None, :]
      return counts + jnp.sum(ge.astype(jnp.int32), axis=0)
    return lax.fori_loop(0, n_blocks, body, jnp.zeros((C,), jnp.int32))

  def refine(state):
    lo, shift, _, c_hi = state
    new_shift = jnp.maximum(shift - bits, 0)
    # int32 addition wraps: lo + j 2^s' is the unsigned-order threshold
    # mapped back to the signed keys.
    counts = count_at_least(lo + (digit << new_shift))
    counts = jnp.where(digit < (1 << (shift - new_shift)), counts, 0)
    enough = counts >= k
    lo = lo + ((jnp.sum(enough.astype(jnp.int32)) - 1) << new_shift)
    c_lo = jnp.min(jnp.where(enough, counts, INT32_MAX))
    c_hi = jnp.maximum(c_hi, jnp.max(jnp.where(enough, 0, counts)))
    return lo, new_shift, c_lo, c_hi

  def unresolved(state):
    _, shift, c_lo, _ = state
    # At least one pass: the compaction shifts by s <= 32 - bits.
    return (shift == 32) | ((shift > 0) & (c_lo > k))

  init = (jnp.int32(INT32_MIN), jnp.int32(32), jnp.int32(n_blocks * BLK),
          jnp.int32(0))
  lo, shift, _, c_hi = lax.while_loop(unresolved, refine, init)

  # Arithmetic shifts keep the order, and the bucket [lo, lo + 2^s) is
  # aligned: a key is in it iff key >> s == lo >> s (no lo + 2^s overflow).
  bucket = lo >> shift
  need = k - c_hi  # bucket keys to take, the first ones by index

  def emit(i, carry):
    n_taken, n_in_bucket = carry
    x, pos, key, valid = load_block(i)
    # A padding lane taken as a candidate carries the float of its key
    # INT32_MIN (bits 0xFFFFFFFF, a NaN), so that the second call orders it
    # below every real candidate too.
    x = jnp.where(valid, x, lax.bitcast_convert_type(
        jnp.full((BLK,), -1, jnp.int32), jnp.float32))
    kb = key >> shift
    above = kb > bucket
    inside = kb == bucket
    ins = inside.astype(jnp.int32)
    rank = n_in_bucket + jnp.cumsum(ins) - ins  # bucket keys before the lane
    take = above | (inside & (rank < need))
    tk = take.astype(jnp.int32)
    slot = n_taken + jnp.cumsum(tk) - tk
    # Untaken lanes point past the output: interpret mode discharges a
    # masked store as a scatter, where a live slot would race.
    dst = jnp.where(take, p * k + slot, P * k)
    if from_candidates:
      index = plt.load(cand_idx_ref.at[b, pl.ds(start + i * BLK, BLK)],
                       mask=take, other=0)
    else:
      index = pos
    plt.store(val_ref.at[b, dst], x, mask=take)
    plt.store(idx_ref.at[b, dst], index, mask=take)
    return n_taken + jnp.sum(tk), n_in_bucket + jnp.sum(ins)

  lax.fori_loop(0, n_blocks, emit, (jnp.int32(0), jnp.int32(0)))


def default_tuning(B, S, k):
  """Blocks of up to 8192 keys at 8 warps, so that a chunk, a group or the
  last call's candidates sit in one block, loaded once; 2-bit passes, 3
  stages; a first call over chunks of about two programs per SM, their
  length rounded to a power of two (at least 2 k keys); from 8192
  candidates a row, calls over groups of 4 of the previous call's
  segments.  Measured on an H200 at B = 16, S = 34816
  (`scripts/bench_attention.py --topk_sweep`): k = 128 / 304 / 512 in
  22.2 / 28.7 / 30.7 us (17 chunks of 2048; groups at k = 512 only),
  against 34.9 / 55.0 / 48.7 us in blocks of 1024 keys at 4 warps (chunks
  of 2176), re-read from L1/L2 by every pass; 4-bit passes are slower
  (56 us at k = 512), as is one program per row (228-440 us)."""
  chunks = min(max(1, round(2 * common.num_sms() / B)), S // (4 * k))
  chunk = 1 << round(math.log2(S / chunks)) if chunks > 1 else 0
  group = 4 if chunk and common.cdiv(S, chunk) * k >= 8192 else 0
  return dict(block=8192, chunk=chunk, group=group, radix_bits=2, num_warps=8,
              num_stages=3)


def _select(x, k, cand_idx, *, L, block, radix_bits, num_warps, num_stages,
            interpret):
  """One call: the top-k of each L-long segment of x's rows ([B, P * k],
  segment p in slots p * k ..); indices from cand_idx when given."""
  B, N = x.shape
  P = common.cdiv(N, L)
  kernel = functools.partial(_kernel, k=k, N=N, L=L, P=P, BLK=block,
                             bits=radix_bits,
                             from_candidates=cand_idx is not None)
  args = [x] if cand_idx is None else [x, cand_idx]
  return pl.pallas_call(
      kernel,
      grid=(B, P),
      out_shape=[jax.ShapeDtypeStruct((B, P * k), jnp.float32),
                 jax.ShapeDtypeStruct((B, P * k), jnp.int32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps,
                                         num_stages=num_stages),
      interpret=interpret,
      name="topk" if cand_idx is not None or P == 1 else "topk_chunks",
  )(*args)


def topk_gpu(scores, k, *, interpret=False, **tuning
             ) -> tuple[jax.Array, jax.Array]:
  """(values f32[B, k], indices int32[B, k]) in ascending index order: the k
  largest of each row of scores [B, S], ties to the lower index.

  **tuning: block (keys per step of a walk, a power of two), chunk (positions
  per program of a first call over row chunks, >= k; 0: one call, one
  program per row), group (segments of candidates per program of the calls
  between the first and the last; 0 or 1: none), radix_bits (threshold bits
  per pass, 2^bits counts per walk), num_warps, num_stages.
  """
  k = check_topk_args(scores, k)
  B, S = scores.shape
  defaults = default_tuning(B, S, k)
  unknown = sorted(tuning.keys() - defaults.keys())
  if unknown:
    raise ValueError(f"unknown tuning {unknown}; known: {sorted(defaults)}")
  tune = defaults | {n: v for n, v in tuning.items() if v is not None}
  block, chunk, bits = tune["block"], tune["chunk"], int(tune["radix_bits"])
  if block < 1 or block & (block - 1):
    raise ValueError(f"block={block} must be a power of two")
  if not 1 <= bits <= 8:
    raise ValueError(f"radix_bits={bits} must be in [1, 8]")
  if chunk and chunk < k:
    raise ValueError(f"chunk={chunk} must be >= k={k}")
  common_args = dict(radix_bits=bits, num_warps=tune["num_warps"],
                     num_stages=tune["num_stages"], interpret=interpret)
  x = scores.astype(jnp.float32)
  if not chunk or chunk >= S:
    return _select(x, k, None, L=S, block=min(block, common.next_pow2(S)),
                   **common_args)
  vals, idx = _select(x, k, None, L=chunk, block=min(block, common.next_pow2(chunk)),
                      **common_args)
  group = int(tune["group"])
  while group > 1 and vals.shape[1] // k >= 2 * group:
    vals, idx = _select(vals, k, idx, L=group * k,
                        block=min(block, common.next_pow2(group * k)),
                        **common_args)
  n = vals.shape[1]
  return _select(vals, k, idx, L=n, block=min(block, common.next_pow2(n)),
                 **common_args)
