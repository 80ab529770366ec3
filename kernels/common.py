"""Small helpers shared by the attention kernels (one place for each).

Conventions shared by every flash-decoding style kernel of this package:

* queries of one KV head are packed as rows ``r = t * G + g`` (verify token
  ``t``, head ``g`` of the GQA group); in the natural query layout
  ``[B, T, Hq, D]`` reshaped (for free) to ``[B, T * Hq, D]`` that row is
  ``t * Hq + h * G + g`` for KV head ``h``;
* partial results of a split-K pass are ``o: f32[J, B, R, D]`` (un-normalised
  output), ``m: f32[J, B, R]`` (running max of the logits **in log2 units**,
  i.e. ``scale * log2(e) * q.k``) and ``l: f32[J, B, R]`` (sum of
  ``exp2(logit - m)``), with ``R = T * Hq`` in the natural row order, so that
  :func:`combine_partials` reduces over the leading axis and lands directly in
  the ``[B, T, Hq, D]`` layout.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def default_scale(head_dim: int, scale: float | None) -> float:
  return float(1.0 / math.sqrt(head_dim)) if scale is None else float(scale)


def backend() -> str:
  """'gpu', 'tpu' or 'cpu' (what ``impl="auto"`` dispatches on)."""
  return jax.default_backend()


def is_hopper() -> bool:
  """Whether the first device is a Hopper GPU (compute capability 9.x: TMA
  and WGMMA, what the Mosaic GPU kernels need)."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def resolve_impl(impl: str) -> str:
  """Maps ``impl`` ("auto" | "reference" | "gpu" | "tpu") to a concrete one."""
  if impl not in ("auto", "reference", "gpu", "tpu"):
    raise ValueError(f"unknown impl {impl!r}")
  if impl != "auto":
    return impl
  plat = backend()
  if plat in ("gpu", "cuda", "rocm"):
    return "gpu"
  if plat == "tpu":
    return "tpu"
  return "reference"


def num_sms(default: int = 132) -> int:
  """Streaming multiprocessors of the first GPU (132 on an H200)."""
  try:
    dev = jax.devices()[0]
    n = getattr(dev, "core_count", None)
    return int(n) if n else default
  except Exception:  # pragma: no cover - no device info
    return default


def check_attention_shapes(q, k, v=None):
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [B,T,Hq,D], k [B,Hkv,S,D]; got {q.shape}, {k.shape}")
  B, T, Hq, D = q.shape
  Bk, Hkv, S, Dk = k.shape
  if Bk != B or Dk != D:
    raise ValueError(f"batch/head_dim mismatch: q {q.shape}, k {k.shape}")
  if v is not None and v.shape != k.shape:
    raise ValueError(f"v {v.shape} must have the shape of k {k.shape}")
  if Hq % Hkv:
    raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
  return B, T, Hq, D, Hkv, S


def combine_partials(o, m, l, out_dtype, valid=None):
  """Merges split-K partial softmax results.

  Args:
    o: f32[J, B, R, D] un-normalised partial outputs.
    m: f32[J, B, R] running max in log2 units (may be -inf: no key seen).
    l: f32[J, B, R] partial sums of exp2(logit - m).
    out_dtype: dtype of the result.
    valid: optional bool[J, B]; False marks splits a kernel skipped (their
      o/m/l are uninitialised memory and must not be read as numbers).
  Returns:
    [B, R, D] in out_dtype.
  """
  if valid is not None:
    vm = valid[:, :, None]
    m = jnp.where(vm, m, -jnp.inf)
  m_max = jnp.max(m, axis=0)
  m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
  w = jnp.exp2(m - m_max[None])  # 0 where m == -inf
  if valid is not None:
    w = jnp.where(vm, w, 0.0)
    l = jnp.where(vm, l, 0.0)
    o = jnp.where(vm[..., None], o, 0.0)
  l_tot = jnp.sum(w * l, axis=0)
  o_tot = jnp.sum(w[..., None] * o, axis=0)
  return (o_tot / l_tot[..., None]).astype(out_dtype)


# ---- the packed q/k/v of a block (window_attention, sparse_verify_packed):
# qkv [B, T, Hkv, G + 2, D], per KV head h its G query heads (query head
# h * G + g), then k_new, then v_new; q and k before RoPE.


def unpack_qkv(qkv):
  """(q [B, T, Hq, D], k_new [B, T, Hkv, D], v_new [B, T, Hkv, D]) of the
  packed qkv [B, T, Hkv, G + 2, D]: per KV head h its G query heads (query
  head h * G + g), then k, then v."""
  B, T, Hkv, G2, D = qkv.shape
  G = G2 - 2
  return (qkv[:, :, :, :G].reshape(B, T, Hkv * G, D), qkv[:, :, :, G],
          qkv[:, :, :, G + 1])


def rope(x, cos, sin):
  """x: [B, T, H, D]; cos, sin: [B, T, D // 2] f32.  Rotate-half RoPE in f32,
  cast to x's dtype: the same arithmetic as the model's ``apply_rope`` with
  its tables [cos, cos] and [sin, sin]."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  c = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]
  s = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
  return (xf * c + rotated * s).astype(x.dtype)


def write_block(cache, new, lengths):
  """cache [B, Hkv, S, D] with new [B, T, Hkv, D] at rows lengths[b] + t
  (rows past S dropped)."""
  B, T = new.shape[:2]
  rows = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  seq = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  return cache.at[seq, :, rows].set(new.astype(cache.dtype), mode="drop")


def check_packed_shapes(qkv, k_cache, v_cache, lengths, cos, sin):
  """Validates the arguments of a packed q/k/v kernel (window_attention,
  sparse_verify_packed); returns (B, T, Hq, D, Hkv, S)."""
  if qkv.ndim != 5 or k_cache.ndim != 4:
    raise ValueError(f"qkv must be [B, T, Hkv, G + 2, D], k_cache [B, Hkv, S, "
                     f"D]; got {qkv.shape}, {k_cache.shape}")
  B, T, _, G2, D = qkv.shape
  Hkv, S = k_cache.shape[1:3]
  if k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape:
    raise ValueError(f"k_cache, v_cache must be [B, Hkv, S, D] with qkv's "
                     f"B={B}, D={D}; got {k_cache.shape}, {v_cache.shape}")
  if qkv.shape[2] != Hkv or G2 < 3:
    raise ValueError(f"qkv must be [B, T, Hkv, G + 2, D] with the caches' "
                     f"Hkv={Hkv} and G = Hq // Hkv >= 1; got {qkv.shape}")
  Hq = Hkv * (G2 - 2)
  if D % 2:
    raise ValueError(f"head_dim {D} must be even (RoPE halves)")
  if cos.shape != (B, T, D // 2) or sin.shape != cos.shape:
    raise ValueError(f"cos, sin must be [B, T, D // 2] = {(B, T, D // 2)}; "
                     f"got {cos.shape}, {sin.shape}")
  if lengths.shape != (B,):
    raise ValueError(f"lengths must be int32[B={B}], got {lengths.shape}")
  if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
    raise ValueError(f"caches ({k_cache.dtype}, {v_cache.dtype}) must have "
                     f"qkv's dtype {qkv.dtype}")
  return B, T, Hq, D, Hkv, S
