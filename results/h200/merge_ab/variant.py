"""Probe: the merge of the split attention programs' partials, one variant
per process, in the whole step (`scripts.bench_e2e` or `scripts.trace_step`,
vanilla in the same process).

At the default 16 + 2032-row draft window the window kernel runs 8 programs
per (sequence, KV head) and XLA merges their partials in two kernels a call
(an exp2 fusion, then the weighted sums): 192 of the step's 1407 launches at
32k x 16, and the verify's listed attention 56 more (results/h100/default_window/).
The variants remove or shorten those kernels:

  default     the package as shipped;
  splits4     at most 4 window programs per (sequence, KV head): one merge
              kernel a call at 4 programs (the step at 496 rows), each
              program walking 4 window tiles instead of 2;
  one_reduce  the window kernel's merges (the draft's window and the verify's
              listed attention; not vanilla's decode_attention) as one variadic
              reduction over the splits whose combiner is the online-softmax
              merge, so there is no shared exp2 intermediate for XLA to
              materialise; `one_reduce_combine` below, equal to
              `kernels.common.combine_partials` (`--check` on the CPU).
  kernel_merge    the window kernel's partials (draft window and verify
              list) merged inside the kernel by the last of a (sequence,
              KV head)'s programs to arrive (`merge="kernel"`, an option
              that only the code of commit 2c5a446 has): no merge kernel
              at all, one zeroed counter per call;
  kernel_merge16  the same with up to 16 window programs (one 128-row tile
              each at 2032 rows).

Measured on an H100: results/h100/merge_ab/ (none faster than default).

Usage (repository root): python results/h200/merge_ab/variant.py
  --variant=splits4 --module=bench_e2e [the module's own flags]
"""
from __future__ import annotations

import os
import runpy
import sys
import types

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from kernels import common  # noqa: E402
from kernels.window_attention import gpu as window_gpu  # noqa: E402
from kernels.window_attention.ops import window_attention  # noqa: E402
from kernels.window_attention.reference import window_attention_reference  # noqa: E402


def one_reduce_combine(o, m, l, out_dtype, valid=None):
  """`combine_partials` as one reduction over the split axis: the operands
  (m, l, o) per split, m and l broadcast over the head dim, combined
  pairwise by the online-softmax merge (associative and commutative)."""
  if valid is not None:
    vm = valid[:, :, None]
    m = jnp.where(vm, m, -jnp.inf)
    l = jnp.where(vm, l, 0.0)
    o = jnp.where(vm[..., None], o, 0.0)
  m = jnp.broadcast_to(m[..., None], o.shape)
  l = jnp.broadcast_to(l[..., None], o.shape)

  def merge(a, b):
    (ma, la, oa), (mb, lb, ob) = a, b
    mm = jnp.maximum(ma, mb)
    ref = jnp.where(jnp.isfinite(mm), mm, 0.0)  # both empty: weights 0
    wa, wb = jnp.exp2(ma - ref), jnp.exp2(mb - ref)
    return mm, la * wa + lb * wb, oa * wa + ob * wb

  zero = jnp.float32(0)
  _, l_tot, o_tot = lax.reduce((m, l, o), (jnp.float32(-jnp.inf), zero, zero), merge, (0,))
  return (o_tot / l_tot).astype(out_dtype)


def apply(variant: str) -> None:
  if variant == "splits4":
    window_gpu.MAX_SPLITS = 4
  elif variant == "one_reduce":  # the window kernel's module only: vanilla's merge stays
    window_gpu.common = types.SimpleNamespace(**vars(common))
    window_gpu.common.combine_partials = one_reduce_combine
  elif variant in ("kernel_merge", "kernel_merge16"):
    if "merge" not in window_gpu.default_tuning(2032):
      raise SystemExit(f"{variant} needs the window kernel's merge='kernel' option, "
                       f"which only the code of commit 2c5a446 has")
    if variant == "kernel_merge16":
      window_gpu.MAX_SPLITS = 16
    for name in ("default_tuning", "listed_tuning"):
      tuning = getattr(window_gpu, name)
      setattr(window_gpu, name, lambda *a, _t=tuning: _t(*a) | {"merge": "kernel"})
  elif variant != "default":
    raise ValueError(f"unknown variant {variant!r}: default, splits4, one_reduce, "
                     f"kernel_merge or kernel_merge16")


def check() -> None:
  """The candidate against combine_partials on random partials, empty
  splits (m = -inf) and invalid ones included, then inside the window
  kernel."""
  k = jax.random.split(jax.random.key(0), 4)
  J, B, R, D = 8, 3, 14, 64
  o = jax.random.normal(k[0], (J, B, R, D), jnp.float32)
  m = 4 * jax.random.normal(k[1], (J, B, R), jnp.float32)
  m = m.at[2].set(-jnp.inf).at[5, 1].set(-jnp.inf)
  l = jnp.where(jnp.isfinite(m), jax.random.uniform(k[2], (J, B, R)) + 0.5, 0.0)
  valid = jax.random.uniform(k[3], (J, B)) > 0.2
  valid = valid.at[0].set(True)
  for v in (None, valid):
    want = common.combine_partials(o, m, l, jnp.float32, v)
    got = one_reduce_combine(o, m, l, jnp.float32, v)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err < 1e-5, err
    print(f"one_reduce_combine == combine_partials (valid={'given' if v is not None else None}): "
          f"max abs diff {err:.2e}")
  # The window kernel with the candidate applied, at 8 programs per head
  # (2032 window rows), against its reference: compiled on a GPU, in
  # interpret mode elsewhere.
  B, T, Hkv, G, D, S = 3, 1, 2, 7, 64, 2400
  lengths = jnp.array([2200, 1000, 300], jnp.int32)
  k = jax.random.split(jax.random.key(1), 3)
  qkv = jax.random.normal(k[0], (B, T, Hkv, G + 2, D), jnp.float32)
  kc = jax.random.normal(k[1], (B, Hkv, S, D), jnp.float32)
  vc = jax.random.normal(k[2], (B, Hkv, S, D), jnp.float32)
  ang = (lengths[:, None, None] + jnp.arange(T)[None, :, None]) * (
      1e4 ** (-jnp.arange(D // 2) / (D // 2)))
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  want = window_attention_reference(qkv, kc, vc, lengths, cos, sin, n_sink=16, n_window=2032)
  interpret = jax.default_backend() != "gpu"
  cases = [(None, {}, "8 programs per head, one_reduce merge")]
  if "merge" in window_gpu.default_tuning(2032):  # the code of 2c5a446
    cases = [(None, {"merge": "kernel"}, "8 programs per head, merged in the kernel"),
             (16, {"merge": "kernel"}, "16 programs per head, merged in the kernel")] + cases
  for splits, merge, label in cases:
    if not merge:
      apply("one_reduce")
    got = window_attention(qkv, kc, vc, lengths, cos, sin, n_sink=16, n_window=2032,
                           impl="gpu", interpret=interpret, splits=splits, **merge)
    # the written k rows are roped in registers: equal up to f32 rounding
    err = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))
    assert err < 1e-4, (label, err)
    print(f"window_attention ({label}) == reference: max abs diff {err:.2e}")


def main() -> None:
  argv = sys.argv[1:]
  opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv
          if a.startswith(("--variant=", "--module="))}
  if "--check" in argv:
    check()
    return
  apply(opts.get("--variant", "default"))
  module = opts.get("--module", "bench_e2e")
  sys.argv = [f"scripts/{module}.py"] + [a for a in argv
                                          if not a.startswith(("--variant=", "--module="))]
  runpy.run_module(f"scripts.{module}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
