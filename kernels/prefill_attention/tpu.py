"""Causal prefill attention on TPUs: jax's Pallas splash attention.

One splash kernel (``make_splash_mha``, GQA: Hq heads over Hkv K/V heads)
with a lazy ``CausalMask`` over the padded length, vmapped over the batch.
Ragged lengths go in as segment ids: valid tokens are segment 1, padding
segment 0, so a valid query never sees a padded key and every padded query
still sees itself (no empty softmax row). Splash does not scale the logits:
q is pre-scaled. Rows past ``lengths`` are zeroed, as the reference does.

Untested on TPU hardware in this project (no TPU is reachable); written from
the kernel's API (q [H, S, D], k/v [Hkv, S, D], S a multiple of the block).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import common
from kernels.prefill_attention.reference import check_prefill_shapes


def prefill_attention_tpu(q, k, v, lengths, *, scale=None, block=512,
                          interpret=False):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  B, S, Hq, D, Hkv = check_prefill_shapes(q, k, v, lengths)
  lengths = lengths.astype(jnp.int32)
  blk = min(block, common.round_up(S, 128))
  Sp = common.round_up(S, blk)
  pad = ((0, 0), (0, Sp - S), (0, 0), (0, 0))
  scale = common.default_scale(D, scale)
  valid = jnp.arange(S, dtype=jnp.int32)[None, :] < lengths[:, None]
  zero = lambda x: jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))
  qh = jnp.pad(q * jnp.asarray(scale, q.dtype), pad).transpose(0, 2, 1, 3)  # [B, Hq, Sp, D]
  kh = jnp.pad(zero(k), pad).transpose(0, 2, 1, 3)  # padding rows zeroed (may be garbage)
  vh = jnp.pad(zero(v), pad).transpose(0, 2, 1, 3)
  mask = sa.MultiHeadMask([sa.CausalMask((Sp, Sp)) for _ in range(Hq)])
  sizes = sa.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk)
  kernel = sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)
  seg = (jnp.arange(Sp, dtype=jnp.int32)[None, :] < lengths[:, None]).astype(jnp.int32)
  def one(qb, kb, vb, sb):
    return kernel(qb, kb, vb, segment_ids=sa.SegmentIds(q=sb, kv=sb))
  out = jax.vmap(one)(qh, kh, vh, seg).transpose(0, 2, 1, 3)[:, :S]
  return zero(out.astype(q.dtype))
