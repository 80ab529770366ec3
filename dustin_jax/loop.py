"""The one host loop of every decode: step until each sequence stops.

Plain decoding, speculative decoding, the ARR measurement, the offline head
search, the evaluations and the benchmarks all drive their step through
`decode_loop`. A step is any callable `step(state, *inputs) -> (state,
StepOutput)` that donates `state` (a bound step, see `bound_step`).

The host runs one step ahead: step t+1 is queued before step t's outputs
are read, so the host's dispatch overlaps the device's work (the step after
the last one is wasted: finished sequences emit nothing).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import jax
import numpy as np

from dustin_jax.compilation import CompileClock
from dustin_jax.decoding import DecodeStats, StepOutput, collect
from dustin_jax.progress import progress as progress_bar


def decode_loop(step: Callable, state: Any, stats: DecodeStats, *,
                inputs: Iterable | None = None, on_step: Callable | None = None,
                on_output: Callable[[StepOutput], None] | None = None,
                progress: bool = False, total: int | None = None,
                desc: str = "decode") -> tuple[list[list[int]], Any]:
  """Run `step` from `state` until every sequence is done (or `inputs` run
  out), counting into `stats` (steps, tokens, accepted drafts, decode and
  compile time).

  inputs: per-step extra arguments (teacher forcing: the forced block of
    each step); the loop ends after the last one.
  on_step(state, out): device values after each step, before the next step
    consumes (donates) the state.
  on_output(out): the step's output on the host (numpy), in order.
  Returns (emitted tokens per sequence, the final state).
  """
  feed = iter(inputs) if inputs is not None else None
  def call(st):
    if feed is None:
      return step(st)
    args = next(feed, None)
    return None if args is None else step(st, *(args if isinstance(args, tuple) else (args,)))

  outs = []
  bar = progress_bar(desc=desc, total=total, enabled=progress)
  t0 = time.perf_counter()
  with CompileClock() as clock:
    res = call(state)
    while res is not None:
      state, out = res
      if on_step is not None:
        on_step(state, out)
      res = call(state)
      host = jax.device_get(out)
      if not outs:
        stats.first_step_s = time.perf_counter() - t0
      outs.append(host.tokens)
      bar.update(stats.record(host.n_emitted, host.active, host.n_accepted))
      if on_output is not None:
        on_output(host)
      if bool(np.all(host.done)):
        break
    if res is not None:  # the step queued past the end
      state = jax.block_until_ready(res[0])
  stats.decode_s += time.perf_counter() - t0
  stats.decode_compile_s += clock.seconds
  bar.close()
  return collect(outs), state
