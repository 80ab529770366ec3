"""Hugging Face tokenizers built from a GGUF file's own metadata, without torch.

A GGUF checkpoint carries its tokenizer as metadata (``tokenizer.ggml.*`` and
``tokenizer.chat_template``). :func:`load_gguf_tokenizer` turns that into a
``tokenizers.Tokenizer`` wrapped in ``transformers.PreTrainedTokenizerFast``,
the same object (ids, text, special tokens, chat template) that
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` gives, but without
transformers' GGUF loader, which imports torch.

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``)
with one of the pre-tokenizers of :data:`PRE_TOKENIZERS`. The tokenizer is
built as transformers builds it from a GGUF file:

* model: BPE over ``tokenizer.ggml.tokens`` (a token not written in GPT-2's
  byte alphabet is re-spelled as the byte-alphabet form of its UTF-8 bytes)
  and ``tokenizer.ggml.merges``; no unknown token, no dropout;
* normalizer: none;
* pre-tokenizer: for a name that maps to a regex, ``Split(regex, isolated)``
  followed by ``ByteLevel(add_prefix_space=False, use_regex=False)``; for a
  name that maps to None, ``ByteLevel(add_prefix_space=False)`` alone, whose
  built-in split is GPT-2's regex
  (``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``);
* decoder: ``ByteLevel``;
* post-processor: the BOS token before (``tokenizer.ggml.add_bos_token``) and
  the EOS token after (``tokenizer.ggml.add_eos_token``) each sequence, both
  off when the flag is absent;
* added tokens: the tokens of type CONTROL (3) written in the byte alphabet
  as special tokens, those of type USER_DEFINED (4) as plain added tokens,
  neither normalized, so both are matched whole in the text;
* ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: the tokens at
  ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``;
* ``chat_template``: ``tokenizer.chat_template``.

``"smollm"`` (SmolLM2) maps to GPT-2's regex, as in transformers. llama.cpp
additionally splits every digit off first for it; the ids differ only where
a run of two or more whitespace characters is followed by a digit.

One difference from transformers: its GGUF loader also adds the token
``<|endoftext|>`` (a default of its GPT-2 tokenizer class) after the
vocabulary when the vocabulary lacks it, one id past the model's embedding;
no token outside the file's vocabulary is added here. For vocabularies that
have ``<|endoftext|>`` (Qwen2.5, SmolLM2) the two are identical.

Anything else (another tokenizer model, an unknown pre-tokenizer, missing
metadata) raises :class:`GGUFTokenizerError` naming the file and the value.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

__all__ = [
    "GGUFTokenizerError",
    "GGUFTokenizerSpec",
    "PRE_TOKENIZERS",
    "SUPPORTED_MODELS",
    "build_backend_tokenizer",
    "byte_alphabet",
    "load_gguf_tokenizer",
    "read_tokenizer_spec",
]

#: ``tokenizer.ggml.model`` values this module builds.
SUPPORTED_MODELS = ("gpt2",)

# Pieces of the split regexes, in the order they are tried.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_WORD = r"[^\r\n\p{L}\p{N}]?\p{L}+"  # letters, after at most one non-letter, non-newline
_SYMBOLS = r" ?[^\s\p{L}\p{N}]+[\r\n]*"  # punctuation with its trailing newlines
_NEWLINES = r"\s*[\r\n]+"
_SPACES = r"\s+(?!\S)|\s+"  # spaces not followed by text, then any left over


def _split_regex(digits: str) -> str:
  return "|".join((_CONTRACTIONS, _WORD, digits, _SYMBOLS, _NEWLINES, _SPACES))


#: Qwen2's split: single digits.
QWEN2_REGEX = _split_regex(r"\p{N}")
#: Llama 3's split: digits in runs of at most three.
LLAMA3_REGEX = _split_regex(r"\p{N}{1,3}")

#: ``tokenizer.ggml.pre`` -> split regex, or None for GPT-2's byte-level regex.
#: A file without ``tokenizer.ggml.pre`` is read as ``"default"``.
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "qwen2": QWEN2_REGEX,
    "deepseek-r1-qwen": QWEN2_REGEX,
    "llama-bpe": LLAMA3_REGEX,
    "llama3": LLAMA3_REGEX,
    "llama-v3": LLAMA3_REGEX,
}

_CONTROL = 3
_USER_DEFINED = 4


class GGUFTokenizerError(ValueError):
  """A GGUF file whose tokenizer cannot be built (unsupported or missing metadata)."""


def byte_alphabet() -> dict[int, str]:
  """GPT-2's byte alphabet: each byte value -> the printable character that spells it.

  Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
  themselves; the other 68 bytes, in increasing order, get the characters
  U+0100, U+0101, ... (so a space is ``Ġ`` and a newline ``Ċ``).
  """
  printable = set(range(ord("!"), ord("~") + 1))
  printable |= set(range(ord("¡"), ord("¬") + 1))
  printable |= set(range(ord("®"), ord("ÿ") + 1))
  out, extra = {}, 0
  for b in range(256):
    if b in printable:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSpec:
  """The tokenizer metadata of a GGUF file (``tokenizer.*`` keys)."""

  path: str
  model: str
  pre: str
  tokens: Sequence[str]
  token_types: Sequence[int]
  merges: Sequence[str]
  bos_id: int | None = None
  eos_id: int | None = None
  unk_id: int | None = None
  pad_id: int | None = None
  add_bos: bool | None = None
  add_eos: bool | None = None
  chat_template: str | None = None

  def token(self, token_id: int | None) -> str | None:
    """The token string of ``token_id`` as the file spells it (None for None)."""
    if token_id is None:
      return None
    if not 0 <= token_id < len(self.tokens):
      raise GGUFTokenizerError(
          f"{self.path}: special token id {token_id} is outside the vocabulary of "
          f"{len(self.tokens)} tokens")
    return self.tokens[token_id]


def _optional_int(meta: dict[str, Any], key: str) -> int | None:
  v = meta.get(key)
  return None if v is None else int(v)


def _optional_bool(meta: dict[str, Any], key: str) -> bool | None:
  v = meta.get(key)
  return None if v is None else bool(v)


def read_tokenizer_spec(path: str | os.PathLike) -> GGUFTokenizerSpec:
  """The tokenizer metadata of the GGUF file ``path``, checked.

  Raises:
    GGUFTokenizerError: the file's tokenizer model or pre-tokenizer is not
      supported, or its vocabulary or merges are missing.
  """
  from dustin_jax.gguf_file import read_gguf_metadata

  path = os.fspath(path)
  meta = read_gguf_metadata(path, prefix="tokenizer.")
  model = meta.get("tokenizer.ggml.model")
  if model not in SUPPORTED_MODELS:
    raise GGUFTokenizerError(
        f"{path}: tokenizer model (tokenizer.ggml.model) {model!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_MODELS)} (byte-level BPE)")
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFTokenizerError(
        f"{path}: pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported; "
        f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
    if not meta.get(key):
      raise GGUFTokenizerError(f"{path}: GGUF metadata {key} is missing or empty")
  tokens = meta["tokenizer.ggml.tokens"]
  types = meta.get("tokenizer.ggml.token_type") or []
  if types and len(types) != len(tokens):
    raise GGUFTokenizerError(
        f"{path}: {len(types)} token types for {len(tokens)} tokens (tokenizer.ggml.token_type)")
  return GGUFTokenizerSpec(
      path=path, model=model, pre=pre, tokens=tokens, token_types=types,
      merges=meta["tokenizer.ggml.merges"],
      bos_id=_optional_int(meta, "tokenizer.ggml.bos_token_id"),
      eos_id=_optional_int(meta, "tokenizer.ggml.eos_token_id"),
      unk_id=_optional_int(meta, "tokenizer.ggml.unknown_token_id"),
      pad_id=_optional_int(meta, "tokenizer.ggml.padding_token_id"),
      add_bos=_optional_bool(meta, "tokenizer.ggml.add_bos_token"),
      add_eos=_optional_bool(meta, "tokenizer.ggml.add_eos_token"),
      chat_template=meta.get("tokenizer.chat_template"),
  )


def _template(spec: GGUFTokenizerSpec):
  """Post-processor: BOS / EOS around each sequence as the file's flags say."""
  from tokenizers import processors

  bos, eos = spec.token(spec.bos_id), spec.token(spec.eos_id)
  add_bos, add_eos = bool(spec.add_bos) and bos is not None, bool(spec.add_eos) and eos is not None
  pre = f"{bos}:0 " if add_bos else ""
  post = f" {eos}:0" if add_eos else ""
  single = f"{pre}$A:0{post}"
  pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
  special = ([(bos, spec.bos_id)] if add_bos else []) + ([(eos, spec.eos_id)] if add_eos else [])
  return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_backend_tokenizer(spec: GGUFTokenizerSpec):
  """The ``tokenizers.Tokenizer`` described by ``spec`` (see the module docstring)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
  from tokenizers.models import BPE

  spell = byte_alphabet()
  alphabet = frozenset(spell.values())

  def in_alphabet(token: str) -> bool:
    return all(ch in alphabet for ch in token)

  vocab: dict[str, int] = {}
  for i, token in enumerate(spec.tokens):
    if not in_alphabet(token):
      token = "".join(spell[b] for b in token.encode("utf-8"))
    vocab[token] = i
  merges = []
  for m in spec.merges:
    left, sep, right = m.partition(" ")
    if not sep:
      raise GGUFTokenizerError(f"{spec.path}: malformed merge {m!r} (tokenizer.ggml.merges)")
    merges.append((left, right))

  tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                      byte_fallback=False))
  regex = PRE_TOKENIZERS[spec.pre]
  if regex is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = _template(spec)

  pairs = list(zip(spec.tokens, spec.token_types))
  control = [AddedToken(t, normalized=False, special=True)
             for t, kind in pairs if kind == _CONTROL and in_alphabet(t)]
  if control:
    tok.add_special_tokens(control)
  user = [AddedToken(t, normalized=False, special=False)
          for t, kind in pairs if kind == _USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens(user)
  return tok


def load_gguf_tokenizer(path: str | os.PathLike):
  """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF file's metadata.

  Imports neither torch nor transformers' GGUF loader. Takes as long as
  reading the file's metadata (seconds for a 150k-token vocabulary); see
  ``dustin_jax.assets.load_tokenizer`` for a cached version.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    GGUFTokenizerError: the tokenizer is not supported (the message names the
      file and the offending value).
    dustin_jax.config.CheckpointError: the file is not a readable GGUF file.
  """
  from transformers import PreTrainedTokenizerFast

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  spec = read_tokenizer_spec(path)
  backend = build_backend_tokenizer(spec)
  kwargs: dict[str, Any] = dict(
      bos_token=spec.token(spec.bos_id), eos_token=spec.token(spec.eos_id),
      unk_token=spec.token(spec.unk_id), pad_token=spec.token(spec.pad_id),
      clean_up_tokenization_spaces=False,
  )
  if spec.add_bos is not None:
    kwargs["add_bos_token"] = spec.add_bos
  if spec.add_eos is not None:
    kwargs["add_eos_token"] = spec.add_eos
  if spec.chat_template:
    kwargs["chat_template"] = spec.chat_template
  return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
