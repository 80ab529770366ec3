"""Cheap dispatch of a jitted decoding step: models bound, outputs in place.

A decode loop calls its step hundreds of times; what a plain jitted call
pays per call on the host (hashing static arguments, flattening pytrees) and
on the GPU (re-recording the CUDA graph when output buffers move) adds up
to milliseconds per step. `BoundStep` removes both.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

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
  `dustin_jax.config.STABLE_GRAPH_FLAG` pins that one too."""

  def __init__(self, fn, models: Sequence[Model], donate: tuple[int, ...] = (0,),
               *, outputs_from: int, **static):
    leaves, defs = zip(*(jax.tree_util.tree_flatten(m.state) for m in models))
    self._params = tuple(leaves)
    self._outputs_from = outputs_from
    self._slots = None  # (arg shapes, output buffers) of the last call
    # one jitted function per (step, models' structure, settings): binding
    # again (each generate call) reuses its compiled executables
    self._jitted = _bound_jit(fn, tuple(m.graphdef for m in models), defs, tuple(donate),
                              tuple(sorted(static.items())))

  def __call__(self, *args):
    key, slots = self._slots_for(args)
    res = self._jitted(self._params, *args, slots=slots)
    k = self._outputs_from
    self._slots = (key, res[k:])
    return (*res[:k], *_copy_tree(res[k:]))

  def _slots_for(self, args):
    """Output buffers for args of these shapes: the last call's, or zeros."""
    key = tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args))
    if self._slots is not None and self._slots[0] == key:
      return self._slots
    shapes = jax.eval_shape(lambda *a: self._jitted(self._params, *a), *args)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype, device=getattr(s, "sharding", None))
    return key, jax.tree_util.tree_map(zeros, shapes[self._outputs_from:])

  def lower(self, *args):
    return self._jitted.lower(self._params, *args, slots=self._slots_for(args)[1])

  def compiled_count(self) -> int:
    """Executables compiled so far for this step (one per input shape)."""
    return self._jitted._cache_size()


@jax.jit
def _copy_tree(tree):
  return jax.tree_util.tree_map(jnp.copy, tree)


@functools.lru_cache(maxsize=64)
def _bound_jit(fn, graphdefs, treedefs, donate, static):
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
  return jax.jit(flat, donate_argnums=tuple(1 + i for i in donate),
                 donate_argnames=("slots",), keep_unused=True)
