"""One Flax NNX decoder for the Llama-3 family and Qwen2/Qwen2.5.

The architectures differ only in flags of `ModelConfig` (q/k/v bias, tied
embeddings, rope scaling). Linear kernels are stored `[in, out]`.

Each layer runs two fused projections of its normed input: `qkv_proj`
(the q, k and v columns) and `gate_up_proj` (gate and up), one GEMM each
(`qkv_columns` / `gate_up_columns` give the column layouts; the loaders in
`weights.py` assemble them from the Hugging Face tensors).

Attention reads the KV cache through `kernels/`: the full cache
(`decode_attention`), or, when `kv_indices` is given, only those context rows
plus the new block (`sparse_verify_packed`) -- the seam the selection policies use --
or, when `window` is given, only an attention-sink prefix and a recent window
plus the block (`window_attention`: a streaming draft). Both subset paths
run one kernel from the one packed q/k/v projection (`packed_attention`):
it also applies RoPE and writes the block's rows, so the attention of a
draft layer-pass or of a sparse verify layer is one kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dustin_jax import sharding
from dustin_jax.cache import KVCache, write_rows
from dustin_jax.config import ModelConfig, rope_inv_freq
from kernels.common import resolve_impl, round_up
from kernels.decode_attention.ops import decode_attention
from kernels.layer_seam.ops import layer_seam
from kernels.layer_seam.reference import BLOCK as SEAM_BLOCK
from kernels.layer_seam.reference import SeamDims, row_scale, seam_layout
from kernels.sparse_verify.ops import sparse_verify_packed
from kernels.swiglu_mlp import ops as swiglu_mlp_ops
from kernels.swiglu_mlp.reference import stream_layout, unstream_layout
from kernels.window_attention import mosaic_gpu as window_mosaic
from kernels.window_attention.ops import window_attention, window_attention_rows


SHORT_BLOCK = 16  # the Pallas attention kernels serve blocks of at most this many tokens


def block_impl(impl: str, t: int) -> str:
  """The attention impl for a block of t tokens: "auto" runs the reference
  past SHORT_BLOCK (verify blocks and draft passes are short; prefill
  chunks run XLA)."""
  return "reference" if impl == "auto" and t > SHORT_BLOCK else impl


def rope_halves(cos, sin):
  """The first halves of the model's rope tables [..., D] (the halves
  repeat): the [..., D // 2] tables the packed-q/k/v kernels take."""
  return tuple(x[..., :x.shape[-1] // 2] for x in (cos, sin))


def attention(q, k, v, k_cache, v_cache, lengths, impl, mesh):
  """Write the block's rows `k, v [B, T, Hkv, D]` into the caches at
  `lengths`, then attention of `q` over the full cache plus the block.
  Returns (out, k_cache, v_cache). Under a mesh both run per device on its
  own batch rows and KV heads (`shard_map`): no KV row leaves its device,
  and the cache write is a local scatter (split by XLA's partitioner, the
  scatter gathered its updates and indices across devices at every layer)."""
  def local(q, k, v, k_cache, v_cache, lengths):
    k_cache, v_cache = write_rows(k_cache, k, lengths), write_rows(v_cache, v, lengths)
    return decode_attention(q, k_cache, v_cache, lengths, impl=impl), k_cache, v_cache
  impl = block_impl(impl, q.shape[1])
  args = (q, k, v, k_cache, v_cache, lengths)
  if mesh is None:
    return local(*args)
  q_spec, kv_spec = _head_specs(q.shape[2], k_cache.shape[1], mesh)
  rows_spec = P(kv_spec[0], None, kv_spec[1], None)  # [B, T, Hkv, D] like the cache
  specs = (q_spec, rows_spec, rows_spec, kv_spec, kv_spec, sharding.batch_spec(1))
  return jax.shard_map(local, mesh=mesh, in_specs=specs,
                       out_specs=(q_spec, kv_spec, kv_spec), check_vma=False)(*args)


def packed_attention(qkv, k_cache, v_cache, lengths, cos, sin, impl, mesh, *, window=None,
                     kv_indices=None):
  """Attention of a block from its packed projection `qkv [B, T, Hkv, G + 2,
  D]` (before RoPE; `cos, sin [B, T, D]`): RoPE, both cache writes and the
  attention in one kernel, over the sink and window rows (`window = (n_sink,
  n_window)`, `window_attention`: a streaming draft) or over the `kv_indices`
  rows (`sparse_verify_packed`: a sparse verification), each plus the block.
  Returns (out [B, T, Hq, D], k_cache, v_cache), per device under a mesh as
  `attention`."""
  impl = block_impl(impl, qkv.shape[1])

  def local(qkv, k_cache, v_cache, lengths, cos, sin, *indices):
    cos, sin = rope_halves(cos, sin)
    if indices:
      return sparse_verify_packed(qkv, k_cache, v_cache, lengths, indices[0], cos, sin,
                                  impl=impl)
    return window_attention(qkv, k_cache, v_cache, lengths, cos, sin, n_sink=window[0],
                            n_window=window[1], impl=impl)
  indices = () if kv_indices is None else (kv_indices,)
  args = (qkv, k_cache, v_cache, lengths, cos, sin) + indices
  if mesh is None:
    return local(*args)
  g, r2 = qkv.shape[2:4]
  q_spec, kv_spec = _head_specs(g * (r2 - 2), g, mesh)
  qkv_spec = P(kv_spec[0], None, kv_spec[1], None, None)
  table_spec = P(kv_spec[0], None, None)
  specs = ((qkv_spec, kv_spec, kv_spec, sharding.batch_spec(1), table_spec, table_spec)
           + (sharding.batch_spec(2),) * len(indices))
  return jax.shard_map(local, mesh=mesh, in_specs=specs,
                       out_specs=(q_spec, kv_spec, kv_spec), check_vma=False)(*args)


def _head_specs(num_heads, num_kv_heads, mesh):
  """Specs of queries [B, T, Hq, D] and caches [B, Hkv, S, D] that keep each
  query head on the device of its KV head."""
  q_spec = sharding.heads_spec(num_heads, mesh)
  kv_spec = sharding.cache_spec(num_kv_heads, mesh)
  if (q_spec[2] is None) != (kv_spec[1] is None):  # heads must stay aligned with their KV head
    q_spec, kv_spec = sharding.heads_spec(1, mesh), sharding.cache_spec(1, mesh)
  return q_spec, kv_spec


_INIT = nnx.initializers.normal(0.02)


class Linear(nnx.Module):

  def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_INIT(rngs.params(), (d_in, d_out), dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.bias is None:
      # the product in x's dtype (accumulated in f32 by the GEMM): an f32
      # result costs a separate convert kernel and twice the bytes per GEMM
      return jnp.dot(x, self.kernel[...], preferred_element_type=x.dtype)
    y = jnp.dot(x, self.kernel[...], preferred_element_type=jnp.float32)
    return (y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Int8Head(nnx.Module):
  """An LM head [vocab, embed] stored as int8 rows with one f32 scale per
  row (symmetric: the row's largest magnitude maps to 127). A draft only
  proposes tokens that the target then verifies, so its head may be
  approximate: the int8 matrix is half the bf16 bytes that each draft
  pass reads."""

  def __init__(self, w_vd: jax.Array):
    w = w_vd.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    self.weight = nnx.Param(jnp.clip(jnp.round(w / scale[:, None]), -127, 127)
                            .astype(jnp.int8))
    self.scale = nnx.Param(scale)

  def __call__(self, hidden: jax.Array) -> jax.Array:
    # int8 -> hidden's dtype is exact; the row scales apply to the f32 product
    w = self.weight[...].astype(hidden.dtype)
    y = jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)
    return y * self.scale[...]


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))  # None once folded (`fold_into`)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.weight is None:
      return xf.astype(x.dtype)
    return self.weight[...] * xf.astype(x.dtype)

  def fold_into(self, linear: Linear) -> None:
    """Scale the rows of `linear`'s kernel [in, out] (the one projection
    this norm feeds) by the norm's weight, and drop the weight:
    the norm then only normalises. Why: the per-channel scale is otherwise
    an elementwise prologue of that GEMM, which XLA can only fuse into its
    own Triton GEMMs, not hand to cuBLAS (at a verify's 80 rows the 7B's
    q/k/v GEMM takes 12 us with the scale folded and 16 us with it in the
    prologue; `results/h200/README.md`). The product is rounded once, per
    weight, instead of per token: the same precision, other roundings.
    A norm already folded has nothing left to fold."""
    if self.weight is None:
      return
    linear.kernel = nnx.Param(_scale_rows(self.weight[...], linear.kernel[...]))
    self.weight = None


@jax.jit
def _scale_rows(w, kernel):
  return (w.astype(jnp.float32)[:, None] * kernel.astype(jnp.float32)).astype(kernel.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array):
  """cos, sin of shape [B, T, head_dim] (f32) for integer positions [B, T]."""
  inv_freq, scale = rope_inv_freq(cfg)
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, H, D]; rotate-half convention (as Hugging Face checkpoints)."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)


def qkv_columns(num_heads: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
  """The layout of `qkv_proj`'s columns: column j is column `order[j]` of
  the Hugging Face q, k, v projections side by side (`[q | k | v]`).

  Grouped per KV head g: the r = Hq / Hkv query heads g*r .. g*r+r-1 that
  read it (Hugging Face GQA), then k_g, then v_g, each head_dim wide. A
  contiguous shard of whole groups (tensor parallelism over KV heads) holds
  its query heads and their KV head: the sharded GEMM needs no gather."""
  r, hd = num_heads // num_kv_heads, head_dim
  q = np.arange(num_heads * hd).reshape(num_kv_heads, r, hd)
  k = num_heads * hd + np.arange(num_kv_heads * hd).reshape(num_kv_heads, 1, hd)
  v = k + num_kv_heads * hd
  return np.concatenate([q, k, v], axis=1).reshape(-1)


def gate_up_columns(intermediate_size: int) -> np.ndarray:
  """The layout of `gate_up_proj`'s columns (as `qkv_columns`, over
  `[gate | up]`): `[F, 2]` flattened, column 2j gate_j and 2j+1 up_j, so a
  contiguous shard over F holds matching pairs."""
  f = intermediate_size
  return np.stack([np.arange(f), f + np.arange(f)], axis=1).reshape(-1)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
    # q, k, v of every KV-head group in one matrix (`qkv_columns`): one GEMM
    # streams one wide matrix (k and v alone are skinny) and one launch
    # instead of three per layer pass
    self.qkv_proj = Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=cfg.qkv_bias,
                           dtype=dtype, rngs=rngs)
    self.o_proj = Linear(cfg.num_heads * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)

  def packed_qkv(self, x):
    """The projection of normed `x` [B, T, d] as [B, T, Hkv, G + 2, D]: per
    KV head its G query heads, then k, then v (before rope)."""
    b, t, _ = x.shape
    g = self.num_kv_heads
    return self.qkv_proj(x).reshape(b, t, g, self.num_heads // g + 2, self.head_dim)

  def qkv(self, x, cos=None, sin=None):
    """Queries [B, T, Hq, D], keys and values [B, T, Hkv, D] of normed `x`
    [B, T, d], q and k after rope (before it without cos, sin)."""
    qkv = self.packed_qkv(x)
    r = qkv.shape[3] - 2
    q = qkv[:, :, :, :r].reshape(*qkv.shape[:2], self.num_heads, self.head_dim)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    if cos is None:
      return q, k, v
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def out(self, attn):
    """o_proj of the attention output [B, T, Hq, D]."""
    b, t = attn.shape[:2]
    return self.o_proj(attn.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_up_proj = Linear(d, 2 * f, bias=False, dtype=dtype, rngs=rngs)  # gate_up_columns
    self.down_proj = Linear(f, d, bias=False, dtype=dtype, rngs=rngs)
    self.streamed = None  # both matrices in kernels.swiglu_mlp's layout, after `stream()`

  def stream(self):
    """Keep the weights only in the layout of the one-kernel MLP
    (`kernels.swiglu_mlp`), which `add_to` runs for <= 64 rows."""
    self.streamed = nnx.data(nnx.Param(stream_layout(self.gate_up_proj.kernel[...],
                                                     self.down_proj.kernel[...])))
    self.gate_up_proj = self.down_proj = None

  def __call__(self, x):
    gate_up = self.gate_up_proj(x).reshape(x.shape[:-1] + (-1, 2))
    return self.down_proj(jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1])

  def add_to(self, residual, x, impl="auto", prefetch=()):
    """`residual + self(x)`; with streamed weights one kernel (the sum in
    f32, rounded once), its reference beyond the kernel's row count. The
    kernel sends the `prefetch` arrays to L2 as it starts."""
    if self.streamed is None:
      return residual + self(x)
    rows = x.reshape(-1, x.shape[-1])
    if not swiglu_mlp_ops.fits(*rows.shape, rows.dtype):
      impl = "reference"
    out = swiglu_mlp_ops.swiglu_mlp(rows, self.streamed[...], residual.reshape(rows.shape),
                                    prefetch=prefetch, impl=impl)
    return out.astype(residual.dtype).reshape(residual.shape)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.self_attn = Attention(cfg, dtype, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.mlp = MLP(cfg, dtype, rngs)

  # The step (`__call__`) and the layer-major prefill (`models/prefill.py`)
  # share the per-token halves of a layer: `qkv` before the attention and
  # `finish` after it; only the attention between them differs.
  def qkv(self, x, cos, sin):
    """(q, k, v) of the residual stream `x` [B, T, d] (see Attention.qkv)."""
    return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

  def finish(self, x, attn, impl="auto", prefetch=()):
    """The residual stream after this layer, from its input `x` [B, T, d]
    and the attention output `attn` [B, T, Hq, D]; `prefetch`: see
    `MLP.add_to`."""
    x = x + self.self_attn.out(attn)
    return self.mlp.add_to(x, self.post_attention_layernorm(x), impl, prefetch)

  def attention_weights(self):
    """The q/k/v and o matrices, in the order a decode step reads them."""
    return self.self_attn.qkv_proj.kernel[...], self.self_attn.o_proj.kernel[...]

  def __call__(self, x, cos, sin, k_cache, v_cache, lengths, kv_indices, impl, mesh,
               window=None, prefetch=()):
    if window is not None or kv_indices is not None:
      return self.packed_call(x, cos, sin, k_cache, v_cache, lengths, impl, mesh,
                              window=window, kv_indices=kv_indices, prefetch=prefetch)
    q, k, v = self.qkv(x, cos, sin)
    out, k_cache, v_cache = attention(q, k, v, k_cache, v_cache, lengths, impl, mesh)
    return self.finish(x, out, impl, prefetch), k_cache, v_cache, q

  def packed_call(self, x, cos, sin, k_cache, v_cache, lengths, impl, mesh, *, window,
                  kv_indices, prefetch=()):
    """The layer over a subset of the cache (a streaming draft's window or a
    sparse verification's rows): the attention is one kernel
    (`packed_attention`) fed by the packed q/k/v projection."""
    qkv = self.self_attn.packed_qkv(self.input_layernorm(x))
    out, k_cache, v_cache = packed_attention(qkv, k_cache, v_cache, lengths, cos, sin, impl,
                                             mesh, window=window, kv_indices=kv_indices)
    # the roped queries only where a caller taps them (XLA drops them elsewhere)
    r = qkv.shape[3] - 2
    q = qkv[:, :, :, :r].reshape(*x.shape[:2], -1, qkv.shape[-1])
    return self.finish(x, out, impl, prefetch), k_cache, v_cache, apply_rope(q, cos, sin)


def run_block(layer: Block, *args, impl, mesh, window=None, prefetch=()):
  """`layer(*args, impl, mesh)` through one jitted function shared by every
  layer. Why: jit traces and lowers a function once per distinct argument
  shape, so a step with ~150 layer applications (every layer of the target,
  every layer of each draft pass) traces and lowers a layer a few times
  instead of ~150; XLA inlines the calls, so the compiled program is the
  one an inline loop would give."""
  graphdef, state = nnx.split(layer)
  return _block(graphdef, state, prefetch, *args, impl=impl, mesh=mesh, window=window)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "mesh", "window"))
def _block(graphdef, state, prefetch, *args, impl, mesh, window):
  return nnx.merge(graphdef, state)(*args, impl, mesh, window, prefetch)


class Decoder(nnx.Module):
  """Token ids in, final hidden states out; `logits()` projects them."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.embed_tokens = nnx.Param(_INIT(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
    self.layers = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.lm_head = (None if cfg.tie_embeddings else
                    Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))
    self.int8_head = None  # the LM head as int8 rows, after `quantize_head()`
    # whether a layer's MLP kernel sends the next layer's q/k/v and o to L2 (`stream_mlps`)
    self.prefetch_next_layer = False
    self.seam_stream = None  # every layer's o, MLP and q/k/v in one stream, after `fuse_seams()`
    self.seam_rows = 8  # the seam kernel's rows: the pass's, padded to a multiple of this
    # the seam pass's attention kernel on a GPU: "triton" or "mosaic" (`window_impl`)
    self.window_kernel = "triton"

  def __call__(self, tokens: jax.Array, cache: KVCache, *,
               kv_indices: jax.Array | None = None, window: tuple[int, int] | None = None,
               tap_layers=(), impl: str = "auto", mesh=None):
    """Run `tokens[B, T]` at positions `cache.lengths[b] + t`.

    Writes their K/V into the cache (lengths unchanged: commit separately).
    `kv_indices[B, K]`: attend only to those context rows plus the new block
    (None: the full cache); `window = (n_sink, n_window)`: only to the first
    n_sink and the last n_window context rows plus the block (a streaming
    cache). `mesh`: run attention per device (sharded step).
    Returns (hidden [B, T, d] after the final norm,
    cache, {layer: queries [B, T, Hq, D] after rope} for `tap_layers`).
    """
    t = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_tables(self.cfg, positions)
    if (window is not None and self.seam_stream is not None and mesh is None
        and tokens.size <= 64):
      return self._seam_pass(tokens, cache, cos, sin, window, tap_layers, impl)
    x = jnp.take(self.embed_tokens[...], tokens, axis=0)
    taps = {}
    for i, layer in enumerate(self.layers):
      prefetch = ()
      if self.prefetch_next_layer and i + 1 < len(self.layers):
        prefetch = self.layers[i + 1].attention_weights()
      x, k, v, q = run_block(layer, x, cos, sin, cache.k[i], cache.v[i], cache.lengths,
                             kv_indices, impl=impl, mesh=mesh, window=window,
                             prefetch=prefetch)
      cache = cache.with_layer(i, k, v)
      if i in tap_layers:
        taps[i] = q
    return self.norm(x), cache, taps

  def window_impl(self, tokens_shape, impl, window, cache_rows) -> str:
    """The seam pass's attention impl: "mosaic" (the Mosaic GPU kernel of
    `window_attention_rows`) where `window_kernel` asks for it, the impl is
    a GPU's and the kernel takes the shapes; else `block_impl`'s."""
    cfg = self.cfg
    (b, t), g = tokens_shape, cfg.num_kv_heads
    attention_impl = block_impl(impl, t)
    if (self.window_kernel == "mosaic" and resolve_impl(attention_impl) == "gpu"
        and window_mosaic.fits(b, t, g, cfg.num_heads // g, cfg.head_dim,
                               self.embed_tokens.dtype, *window, cache_rows=cache_rows)):
      return "mosaic"
    return attention_impl

  def use_window_kernel(self, kernel: str):
    """The seam pass's attention on a GPU: "triton" (`window_attention`'s
    kernel and an XLA merge of its split programs) or "mosaic" (the Mosaic
    GPU kernel, which merges its splits itself; Hopper, head_dim 64). The
    layer-by-layer pass keeps the Triton kernel: with the Mosaic one (and
    the packing of its inputs) the step took 0.37 ms longer at 32k x 16
    (results/h100/pdl/)."""
    if kernel not in ("triton", "mosaic"):
      raise ValueError(f"the window kernel must be 'triton' or 'mosaic', got {kernel!r}")
    self.window_kernel = kernel

  def _seam_pass(self, tokens, cache, cos, sin, window, tap_layers, impl):
    """`__call__` over a streaming draft's window with the work between two
    attentions as one kernel (`kernels.layer_seam`): layer 0's q/k/v is one
    GEMM; then per layer the q/k/v rows scaled by the residual's RMSNorm
    scale plus the bias (one XLA fusion), the attention (as token rows:
    `window_attention_rows`, on a GPU as `window_impl` says), then layer i's o,
    MLP and layer i + 1's q/k/v. The residual stream stays f32 ([Mp, D], the
    rows padded to a multiple of 8) until the final norm."""
    cfg = self.cfg
    b, t = tokens.shape
    m = b * t
    mp = round_up(m, self.seam_rows)
    dtype = self.embed_tokens.dtype
    f32 = jnp.float32
    dims = self.seam_dims()
    x = jnp.take(self.embed_tokens[...], tokens.reshape(m), axis=0)
    r = jnp.pad(x.astype(f32), ((0, mp - m), (0, 0)))
    qkv = jnp.dot(r.astype(dtype), self.layers[0].self_attn.qkv_proj.kernel[...],
                  preferred_element_type=f32)
    xb = jnp.zeros((mp, cfg.hidden_size), dtype)
    ss = jnp.zeros((mp, SEAM_BLOCK), f32)
    stream = self.seam_stream[...]
    g = cfg.num_kv_heads
    cos_half, sin_half = rope_halves(cos, sin)
    attention_impl = self.window_impl((b, t), impl, window, cache.max_len)
    taps = {}
    for i, layer in enumerate(self.layers):
      attention = layer.self_attn
      scaled = qkv * row_scale(r, cfg.rms_norm_eps)
      if attention.qkv_proj.bias is not None:
        scaled = scaled + attention.qkv_proj.bias[...].astype(f32)
      packed = scaled[:m].astype(dtype).reshape(b, t, g, cfg.num_heads // g + 2, cfg.head_dim)
      attn, k, v = window_attention_rows(packed, cache.k[i], cache.v[i], cache.lengths,
                                         cos_half, sin_half, n_sink=window[0],
                                         n_window=window[1], impl=attention_impl)
      attn = jnp.pad(attn, ((0, mp - m), (0, 0)))
      r, xb, ss, qkv = layer_seam(r, attn, stream, xb, ss, qkv, i, dims=dims,
                                  has_next=i + 1 < len(self.layers), eps=cfg.rms_norm_eps,
                                  impl=impl)
      cache = cache.with_layer(i, k, v)
      if i in tap_layers:
        q = packed[:, :, :, :-2].reshape(b, t, cfg.num_heads, cfg.head_dim)
        taps[i] = apply_rope(q, cos, sin)
    hidden = r[:m].astype(dtype).reshape(b, t, cfg.hidden_size)
    return self.norm(hidden), cache, taps

  def seam_dims(self) -> SeamDims:
    cfg = self.cfg
    return SeamDims(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size,
                    (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)

  def fuse_seams(self, attention: str = "triton"):
    """Every layer's o, MLP and q/k/v matrices also in one stream of blocks
    (`kernels.layer_seam.reference.seam_layout`, layers stacked), which a
    streaming draft's pass of at most 64 rows reads through one kernel per
    layer (`_seam_pass`). The layers keep their weights (the prefill and
    longer blocks run them): the stream is a second copy of all but the
    embeddings (~0.9 GB for Qwen2.5-0.5B). Needs folded norm weights
    (`fold_norm_weights`) and no o bias. `attention`: the pass's attention
    kernel on a GPU (`use_window_kernel`)."""
    self.use_window_kernel(attention)
    blocks = []
    for layer in self.layers:
      attention, mlp = layer.self_attn, layer.mlp
      if layer.input_layernorm.weight is not None or layer.post_attention_layernorm.weight is not None:
        raise ValueError("fuse_seams needs the norm weights folded into the projections "
                         "(fold_norm_weights first)")
      if attention.o_proj.bias is not None:
        raise ValueError("fuse_seams takes layers without an o_proj bias")
      if mlp.streamed is not None:
        gate_up, down = unstream_layout(mlp.streamed[...], self.cfg.hidden_size)
      else:
        gate_up, down = mlp.gate_up_proj.kernel[...], mlp.down_proj.kernel[...]
      blocks.append(seam_layout(attention.o_proj.kernel[...], gate_up, down,
                                attention.qkv_proj.kernel[...]))
    self.seam_stream = nnx.data(nnx.Param(jnp.concatenate(blocks)))

  def fold_norm_weights(self):
    """Each layer's two RMSNorm weights multiplied into the projection they
    feed (q/k/v, gate/up; `RMSNorm.fold_into`). The final norm keeps its
    weight (the embedding matrix may be tied to the LM head). Before
    `stream_mlps`."""
    for layer in self.layers:
      layer.input_layernorm.fold_into(layer.self_attn.qkv_proj)
      layer.post_attention_layernorm.fold_into(layer.mlp.gate_up_proj)

  def stream_mlps(self, prefetch_next_layer: bool = False):
    """Every layer's MLP as one kernel at decode rows (`MLP.stream`; Hopper:
    TMA, WGMMA), its weights kept in that kernel's layout only. With
    `prefetch_next_layer` each layer's kernel sends the next layer's q/k/v
    and o matrices to L2: at a few rows their GEMMs are bound by latency,
    not bandwidth, and loads from L2 arrive sooner. (The next MLP's own
    26 MB, prefetched too, cost its kernel more than they saved.)"""
    for layer in self.layers:
      layer.mlp.stream()
    self.prefetch_next_layer = prefetch_next_layer

  def quantize_head(self):
    """The LM head as int8 rows with per-row scales (`Int8Head`), for a
    draft: it reads half the bytes. The embedding stays for the token
    lookup; an untied head's matrix is replaced."""
    if self.int8_head is not None:
      return
    w = self.embed_tokens[...] if self.lm_head is None else self.lm_head.kernel[...].T
    self.int8_head = nnx.data(Int8Head(w))
    self.lm_head = None

  def logits(self, hidden: jax.Array) -> jax.Array:
    """f32 logits [..., vocab] of final hidden states."""
    if self.int8_head is not None:
      return self.int8_head(hidden)
    if self.lm_head is None:
      w = self.embed_tokens[...]
      return jnp.einsum("...d,vd->...v", hidden, w, preferred_element_type=jnp.float32)
    return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
