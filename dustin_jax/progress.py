"""The one progress bar of the project (tqdm; off when `enabled` is False)."""

from __future__ import annotations


def progress(iterable=None, *, desc: str, total: int | None = None, enabled: bool = True,
             **kw):
  """A tqdm bar over `iterable` (or to update by hand up to `total`) that
  disappears when done; `kw` passes tqdm options (units of bytes, ...)."""
  from tqdm.auto import tqdm
  return tqdm(iterable, desc=desc, total=total, disable=not enabled, leave=False, **kw)
