"""Compile once: the persistent XLA compilation cache, and compile time as a
measured quantity.

A decode job compiles the prefill and the step of two models; cold, that is
tens of seconds on a GPU, paid again by every run of the same config unless
XLA's executables are kept on disk. `enable_persistent_cache` keeps them
under the project's cache root (`<root>/xla`). `CompileClock` sums the
compile time JAX reports (tracing, lowering, and the backend compile or the
persistent-cache load) while it is open, so a run can report compile time
apart from the work it compiled.
"""

from __future__ import annotations

import os
import pathlib
import threading

import jax

# the compile stages JAX times (jax.monitoring duration events)
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_lock = threading.Lock()
_total = [0.0]
_registered = [False]


def _listener(event: str, duration: float, **_):
  if event in _COMPILE_EVENTS:
    with _lock:
      _total[0] += duration


def compile_seconds() -> float:
  """Seconds JAX has spent compiling in this process since the first clock."""
  with _lock:
    return _total[0]


class CompileClock:
  """Compile seconds spent while open: `with CompileClock() as c: ...; c.seconds`."""

  def __init__(self):
    if not _registered[0]:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      _registered[0] = True
    self.seconds = 0.0
    self._start = 0.0

  def __enter__(self) -> "CompileClock":
    self._start = compile_seconds()
    return self

  def __exit__(self, *exc) -> bool:
    self.seconds = compile_seconds() - self._start
    return False


def default_cache_dir() -> pathlib.Path:
  from dustin_jax.assets import cache_root  # (the one cache root of the project)
  return cache_root() / "xla"


def use_compile_cache(setting: str) -> pathlib.Path | None:
  """The compilation cache a run's setting asks for: "auto" keeps it under
  the project's cache root, "" turns it off, anything else is the directory
  to keep it in. Returns the directory (None: off)."""
  if not setting:
    return None
  return enable_persistent_cache(None if setting == "auto" else setting)


def enable_persistent_cache(path: str | os.PathLike | None = None) -> pathlib.Path:
  """Keep compiled XLA executables in `path` (default `<cache root>/xla`),
  every compile (a cache load is cheaper than any compile but the most
  trivial). Returns the directory."""
  path = pathlib.Path(path).expanduser() if path else default_cache_dir()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
