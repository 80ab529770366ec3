"""Cheap dispatch of a jitted decoding step: models bound, outputs in place.

A decode loop calls its step hundreds of times; what a plain jitted call
pays per call on the host (hashing static arguments, flattening pytrees) and
on the GPU (re-recording the CUDA graph when output buffers move) adds up
to milliseconds per step. `BoundStep` removes both.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from dustin_jax.decoding import Model


class BoundStep:
  """A jitted step with its models bound: `fn(graphdef_1, params_1, ...,
  graphdef_n, params_n, *args, **static)` becomes `step(*args)`.

  Why: a plain jitted call hashes its static arguments and flattens its
  pytrees on every call. For nnx graphdefs (~1 ms to hash each) and States
  of a few hundred arrays that is milliseconds of host time per step, paid
  on every step of a decode loop. Here the graphdefs and the
  static settings are closed over and the params flattened once; the args
  at positions `donate` are donated. The params are bound: bind again after
  replacing them.

  `outputs_from`: the results from that position on (the step's outputs, not
  its carried state) are written into buffers the step owns, donated back
  into every call, and the caller gets copies of them (a second, one-kernel
  executable). Why: on GPU, XLA launches the step as one CUDA graph and
  re-records every command that touches a buffer whose address changed
  since the last launch. Freshly allocated outputs change address every
  step, and XLA also places the step's temporaries in them, so with fresh
  outputs XLA re-records nearly every command of the step before every
  launch (milliseconds of host time per step). With every result aliased to a
  donated input only the temporary buffer can still move between launches;
  the update mode in `dustin_jax.config.GRAPH_FLAGS` pins that one too."""

  def __init__(self, fn, models: Sequence[Model], donate: tuple[int, ...] = (0,),
               *, outputs_from: int, **static):
    leaves, defs = zip(*(jax.tree_util.tree_flatten(m.state) for m in models))
    self._params = tuple(leaves)
    self._outputs_from = outputs_from
    self._slots = None  # (arg shapes, output buffers) of the last call
    self._bind = (fn, tuple(m.graphdef for m in models), defs, tuple(donate),
                  tuple(sorted(static.items())))
    self._jitted = None  # made at the first call, once the placement is known

  def __call__(self, *args):
    args, slots = self._prepare(args)
    res = self._jitted(self._params, *args, slots=slots)
    k = self._outputs_from
    self._slots = (self._key(args), res[k:])
    return (*res[:k], *_copy_tree(res[k:]))

  @staticmethod
  def _key(args):
    return tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args))

  def _prepare(self, args):
    """(args, output buffers): the last call's buffers, or, for args of new
    shapes, the args placed and zeros. The placement is fixed at the first
    call and pinned as the step's output shardings, so every call sees the
    same input shardings: under a mesh the shardings XLA would propagate
    drift over the first calls, each drift a recompile of the whole step.
    Leaves sharded over a mesh keep their sharding; the rest (and the
    outputs) are replicated over it, or put on the first device without one."""
    key = self._key(args)
    if self._slots is not None and self._slots[0] == key:
      return args, self._slots[1]
    leaves = jax.tree_util.tree_leaves(args)
    sharded = lambda x: isinstance(getattr(x, "sharding", None), NamedSharding)
    mesh = next((x.sharding.mesh for x in leaves if sharded(x)), None)
    whole = (SingleDeviceSharding(jax.devices()[0]) if mesh is None
             else NamedSharding(mesh, PartitionSpec()))
    keep = lambda x: x.sharding if mesh is not None and sharded(x) else whole
    placement = jax.tree_util.tree_map(keep, args)
    args = jax.device_put(args, placement)
    plain = _bound_jit(*self._bind, out_shardings=None)
    outputs = jax.eval_shape(lambda *a: plain(self._params, *a), *args)[self._outputs_from:]
    if self._jitted is None:
      outs = jax.tree_util.tree_map(lambda _: whole, outputs)
      pinned = (*placement[:self._outputs_from], *outs)
      self._jitted = _bound_jit(*self._bind, out_shardings=_Hashable(pinned))
    zeros = lambda s: jnp.zeros(s.shape, s.dtype, device=whole)
    return args, jax.tree_util.tree_map(zeros, outputs)

  def lower(self, *args):
    args, slots = self._prepare(args)
    return self._jitted.lower(self._params, *args, slots=slots)

  def compiled_count(self) -> int:
    """Executables compiled so far for this step, its models' structure and
    settings (any binding: one per input shape and placement)."""
    return sum(j._cache_size() for key, j in _JITS.items() if key[:5] == self._bind)


class _Hashable:
  """A pytree of shardings as an lru_cache key."""

  def __init__(self, tree):
    self.tree = tree
    leaves, self._def = jax.tree_util.tree_flatten(tree)
    self._leaves = tuple(leaves)

  def __hash__(self):
    return hash((self._def, self._leaves))

  def __eq__(self, other):
    return self._def == other._def and self._leaves == other._leaves


@jax.jit
def _copy_tree(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


_JITS = {}  # one jitted function per (step, models' structure, settings, placement)


def _bound_jit(fn, graphdefs, treedefs, donate, static, *, out_shardings):
  key = (fn, graphdefs, treedefs, donate, static, out_shardings)
  if key not in _JITS:
    _JITS[key] = _make_jit(*key)
  return _JITS[key]


def _make_jit(fn, graphdefs, treedefs, donate, static, out_shardings):
  def flat(params, *args, slots=()):
    # `slots` is donated and comes last, after the state: jit pairs donated
    # inputs with results of the same shape in order, so the state's results
    # take the state's buffers and the outputs take the slots' (see BoundStep)
    del slots
    bound = []
    for g, d, p in zip(graphdefs, treedefs, params):
      bound += [g, jax.tree_util.tree_unflatten(d, p)]
    return fn(*bound, *args, **dict(static))
  # keep_unused: a donated input the step never reads (a signal it only
  # overwrites) stays a parameter, so its result is aliased to it too
  kw = {} if out_shardings is None else dict(out_shardings=out_shardings.tree)
  return jax.jit(flat, donate_argnums=tuple(1 + i for i in donate),
                 donate_argnames=("slots",), keep_unused=True, **kw)
