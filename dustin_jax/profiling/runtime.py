"""Shared machinery of the offline profiling and the long-context evaluation.

* `Pair("real" | "tiny")`: the real offline pair of `dustin_jax.assets`
  (Qwen2.5-Coder-1.5B target, 0.5B draft, their tokenizer) or two tiny random
  models with a byte tokenizer (smoke tests), weights loaded on first use;
* `prefill_base`: ONE prefill of both models per batch of prompts; every
  policy then starts from a copy of those caches (`fresh_state`), since the
  jitted step donates its state;
* `run_policy`: speculative decoding from such a state through the one step
  and the one loop, optionally with the ARR measured at every step
  (`StepOptions`), with per-step hooks;
* `sparse_ppl`: teacher-forced perplexity of real continuations verified
  against a policy's subset;
* `evaluate_arr`: speculative decoding of prompts with the ARR measured;
* `text_prompt`: a prompt cut from a real text at a random line start.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import hashlib
import json
import os
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dustin_jax import weights
from dustin_jax.assets import ensure_model, load_tokenizer
from dustin_jax.cache import KVCache
from dustin_jax.config import ModelConfig
from dustin_jax.decoding import DecodeState, DecodeStats, Model, StepOutput
from dustin_jax.gguf_file import read_gguf_config
from dustin_jax.loop import decode_loop
from dustin_jax.models.prefill import DEFAULT_TOKEN_BLOCK
from dustin_jax.prefill import prefill
from dustin_jax.speculative.engine import generate_speculative
from dustin_jax.speculative.step import SpecConfig, SpecState, StepOptions, bind_spec_step

REAL_TARGET = "qwen2.5-coder-1.5b-instruct"
REAL_DRAFT = "qwen2.5-coder-0.5b-instruct"
QWEN_EOS = (151643, 151645)


class ByteTokenizer:
  """A byte-level tokenizer for the tiny random models of the smoke tests
  (ids = bytes + 3; 0..2 unused)."""
  vocab_size = 259

  def encode(self, text: str) -> list[int]:
    return [b + 3 for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(max(0, int(i) - 3) for i in ids if 3 <= int(i) < 259).decode("utf-8", "replace")


class HFTokenizer:
  """The same two methods over a Hugging Face tokenizer (no special tokens)."""

  def __init__(self, tok):
    self.tok = tok

  def encode(self, text: str) -> list[int]:
    return list(self.tok(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int]) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


# the tiny pair's models: 3 layers over the byte tokenizer's vocabulary
TINY = dict(model_type="qwen2", vocab_size=ByteTokenizer.vocab_size, hidden_size=64,
            intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, rope_theta=1e4,
            tie_word_embeddings=True)


def _noisy(model: Model, scale: float, seed: int) -> Model:
  leaves, tree = jax.tree_util.tree_flatten(model.state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return Model(model.cfg, model.graphdef, jax.tree_util.tree_unflatten(tree, noisy))


def _random_model(cfg, seed: int) -> Model:
  """Random weights with a normal init (std 0.2 on matrices) so that the
  attention is peaked enough to be worth selecting from."""
  graphdef, state = weights.random_params(cfg, seed=seed)
  leaves, tree = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [jax.random.normal(k, x.shape, x.dtype) * 0.2 if x.ndim >= 2 else x
         for x, k in zip(leaves, keys)]
  return Model(cfg, graphdef, jax.tree_util.tree_unflatten(tree, out))


class Pair:
  """A target/draft pair: "real" (the offline Qwen2.5-Coder 1.5B / 0.5B in
  f32, their tokenizer) or "tiny" (random 3-layer models with a byte
  tokenizer; the draft is a noisy copy of the target, so it agrees with the
  target often but not always). The real pair's weights load when `.target`
  or `.draft` is first used: a profile whose calibration data is all cached
  loads none."""

  def __init__(self, kind: str = "real", *, progress: bool = False):
    if kind not in ("real", "tiny"):
      raise ValueError(f"unknown model pair {kind!r}: 'real' or 'tiny'")
    self.progress = progress
    if kind == "tiny":
      self.target = _random_model(ModelConfig.from_hf(TINY, dtype="float32"), seed=0)
      self.draft = _noisy(self.target, 0.3, seed=1)
      self.tokenizer = ByteTokenizer()
      self.target_name, self.draft_name = "tiny-target", "tiny-draft"
    else:
      path = ensure_model(REAL_TARGET, progress=progress)
      self.tokenizer = HFTokenizer(load_tokenizer(path))
      self.target_name, self.draft_name = REAL_TARGET, REAL_DRAFT

  @property
  def model_name(self) -> str:
    return f"{self.target_name}+{self.draft_name}"

  def _load(self, name: str) -> Model:
    model = Model(*weights.load_gguf_checkpoint(str(ensure_model(name, progress=self.progress))))
    release_host_memory()
    return model

  @functools.cached_property
  def target(self) -> Model:
    return self._load(self.target_name)

  @functools.cached_property
  def draft(self) -> Model:
    return self._load(self.draft_name)

  def configs(self) -> tuple[ModelConfig, ModelConfig]:
    """(target, draft) ModelConfigs, without loading weights."""
    if "target" in vars(self) and "draft" in vars(self):
      return self.target.cfg, self.draft.cfg
    return tuple(ModelConfig.from_hf(read_gguf_config(str(ensure_model(n, progress=False))),
                                     dtype="float32") for n in (self.target_name, self.draft_name))


def load_pair(kind: str = "real", *, progress: bool = False) -> Pair:
  """The pair `kind` with both models' weights loaded."""
  pair = Pair(kind, progress=progress)
  _ = pair.target, pair.draft   # loads both now
  return pair


def release_host_memory() -> None:
  """Give the dequantisation temporaries back to the OS (glibc keeps freed
  heap otherwise: ~2 GB for the real pair, which matters on a 24 GB host)."""
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except OSError:
    pass


# --------------------------------------------------------------- states
@dataclasses.dataclass
class Base:
  """Both caches prefilled with `prompt[:-1]` (never donated: copy first)."""
  target: KVCache
  draft: KVCache
  prompts: list
  max_len: int
  prefill_s: float


def prefill_base(pair: Pair, prompts: Sequence[Sequence[int]], max_len: int, *,
                 token_block: int = DEFAULT_TOKEN_BLOCK, progress: bool = False,
                 cache_dir: str | None = None) -> Base:
  """Prefill both models once. With `cache_dir`, the committed KV rows are
  saved there (one .npy per model, keyed by the models and the prompts)
  and a later call (any max_len) with the same key loads them instead of
  recomputing (a 4k-token prefill of the real pair takes minutes on a CPU)."""
  if min(len(p) for p in prompts) < 2:
    raise ValueError("speculative decoding needs prompts of at least 2 tokens")
  if max(len(p) for p in prompts) > max_len:
    raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens does not fit "
                     f"max_len={max_len}")
  t0 = time.perf_counter()
  b = len(prompts)
  path = None
  if cache_dir:
    # rows only: any max_len >= the prompts can reuse them
    key = hashlib.sha256(json.dumps([pair.model_name, pair.target.cfg.dtype,
                                     [list(map(int, p)) for p in prompts]])
                         .encode()).hexdigest()[:20]
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"kv_{key}")
    if os.path.isfile(path + ".target.npy") and os.path.isfile(path + ".draft.npy"):
      lengths = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
      tc = _load_cache(path + ".target.npy", pair.target.cfg, b, max_len, lengths)
      dc = _load_cache(path + ".draft.npy", pair.draft.cfg, b, max_len, lengths)
      jax.block_until_ready((tc, dc))
      return Base(tc, dc, [list(p) for p in prompts], max_len, time.perf_counter() - t0)
  tc = prefill(pair.target, KVCache.init(pair.target.cfg, b, max_len), prompts,
               token_block=token_block)
  dc = prefill(pair.draft, KVCache.init(pair.draft.cfg, b, max_len), prompts,
               token_block=token_block)
  jax.block_until_ready((tc, dc))
  if path is not None:
    rows = max(len(p) for p in prompts) - 1
    for name, c in (("target", tc), ("draft", dc)):
      arr = np.stack([np.stack([np.asarray(k[:, :, :rows]), np.asarray(v[:, :, :rows])])
                      for k, v in zip(c.k, c.v)])      # [L, 2, B, Hkv, rows, D]
      tmp = f"{path}.{name}.tmp.npy"
      np.save(tmp, arr)
      os.replace(tmp, f"{path}.{name}.npy")
      del arr
  return Base(tc, dc, [list(p) for p in prompts], max_len, time.perf_counter() - t0)


def _load_cache(path: str, cfg, batch: int, max_len: int, lengths) -> KVCache:
  arr = np.load(path, mmap_mode="r")
  rows = arr.shape[4]
  pad = ((0, 0), (0, 0), (0, max_len - rows), (0, 0))
  ks = tuple(jnp.pad(jnp.asarray(arr[l, 0], cfg.dtype), pad) for l in range(arr.shape[0]))
  vs = tuple(jnp.pad(jnp.asarray(arr[l, 1], cfg.dtype), pad) for l in range(arr.shape[0]))
  return KVCache(ks, vs, lengths)


def fresh_state(base: Base, policy, max_new_tokens: int, seed: int = 0) -> SpecState:
  """A SpecState over copies of the base caches (the step donates its state)."""
  copy = lambda t: jax.tree_util.tree_map(jnp.copy, t)
  ds = DecodeState.init(base.prompts, max_new_tokens, jax.random.key(seed))
  return SpecState(copy(base.target), copy(base.draft), ds,
                   policy.init(len(base.prompts), base.max_len))


class ARRMeter:
  """Accumulates the ARR of every active (sequence, step) pair from step
  outputs (`decode_loop`'s `on_output`): `mean`, `per_layer` (means),
  `per_step` (mean over the active sequences of each step), `n` pairs."""

  def __init__(self):
    self.total, self.n, self.per_step, self._layers = 0.0, 0, [], 0.0

  def __call__(self, out: StepOutput) -> None:
    active = np.asarray(out.active)
    if out.arr is None or not active.any():
      return
    self.total += float(np.asarray(out.arr)[active].sum())
    self._layers = self._layers + np.asarray(out.arr_per_layer)[active].sum(axis=0)
    self.n += int(active.sum())
    self.per_step.append(float(np.asarray(out.arr)[active].mean()))

  @property
  def mean(self) -> float | None:
    return self.total / self.n if self.n else None

  @property
  def per_layer(self) -> list[float]:
    return (np.asarray(self._layers) / self.n).tolist() if self.n else []


@dataclasses.dataclass
class RunResult:
  tokens: list                      # per sequence, emitted tokens
  stats: DecodeStats
  arr: float | None = None          # mean over active (sequence, step) pairs, if measured
  arr_n: int = 0                    # those pairs


def run_policy(pair: Pair, base: Base, policy, *, gamma: int, max_new_tokens: int,
               eos_ids: tuple[int, ...] = (), measure_arr: bool = False, verify: str = "sparse",
               seed: int = 0, on_step: Callable | None = None, progress: bool = False,
               draft_window: tuple[int, int] | None = None) -> RunResult:
  """Greedy speculative decoding of `base`'s prompts under `policy`.

  measure_arr: the ARR of the policy's set at every step (one extra
  full-cache target pass per step). verify: "sparse" (the policy's own
  verification) or "full" (the lossless trajectory). `on_step(state, out)`
  after each step (`decode_loop`). draft_window: (sink, window) rows the
  draft attends to (a streaming draft cache, as the fast step runs it);
  None: its whole cache."""
  streaming = {} if draft_window is None else dict(
      draft_kv="streaming", draft_sink=draft_window[0], draft_window=draft_window[1])
  cfg = SpecConfig(gamma=gamma, eos_ids=tuple(eos_ids), policy=policy, **streaming)
  options = StepOptions(verify=verify, measure_arr=measure_arr)
  b = len(base.prompts)
  stats = DecodeStats(gamma=gamma, prompt_tokens=sum(len(p) - 1 for p in base.prompts),
                      prefill_s=base.prefill_s)
  meter = ARRMeter()
  step = bind_spec_step(pair.target, pair.draft, cfg, options)
  tokens, _ = decode_loop(step, fresh_state(base, policy, max_new_tokens, seed), stats,
                          on_step=on_step, on_output=meter, progress=progress,
                          total=max_new_tokens * b, desc=f"{policy.name} g{gamma}")
  return RunResult(tokens, stats, meter.mean, meter.n)


def sparse_ppl(pair, base, policy, refs, gamma, return_top1=False):
  """Teacher-forced perplexity of `refs[b]` (the real continuation of each
  prompt) when every block of gamma+1 tokens is verified with the policy's
  I_verify: the speculative step with `StepOptions(teacher_forced=True)`
  (the draft's guesses replaced by the real tokens; the whole block
  committed). Returns (ppl, n tokens) and, with `return_top1`, the target's
  argmax at every scored position (per sequence)."""
  n_blocks = min(len(r) for r in refs) // (gamma + 1)
  blocks = [np.asarray([r[i * (gamma + 1):(i + 1) * (gamma + 1)] for r in refs], np.int32)
            for i in range(n_blocks)]
  nll, top1 = [], []
  def on_output(out):
    nll.append(np.asarray(out.nll))
    top1.append(np.asarray(out.target_top1))
  step = bind_spec_step(pair.target, pair.draft, SpecConfig(gamma=gamma, policy=policy),
                        StepOptions(teacher_forced=True))
  decode_loop(step, fresh_state(base, policy, n_blocks * (gamma + 1)), DecodeStats(gamma=gamma),
              inputs=blocks, on_output=on_output)
  count = sum(x.size for x in nll)
  result = (float(np.exp(sum(x.sum() for x in nll) / max(count, 1))), count)
  if not return_top1:
    return result
  return result + (np.concatenate(top1, axis=1).tolist() if top1 else [[] for _ in refs],)


def evaluate_arr(target: Model, draft: Model, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int, max_len: int, cfg: SpecConfig = SpecConfig(),
                 verify: str = "full", seed: int = 0, token_block: int = DEFAULT_TOKEN_BLOCK):
  """Speculative decoding with the ARR measured at every step; returns
  (token lists, DecodeStats, ARRMeter). With `verify="full"` and greedy sampling the tokens are those
  of full-cache speculative decoding whatever the policy."""
  meter = ARRMeter()
  tokens, stats = generate_speculative(
      target, draft, prompts, max_new_tokens=max_new_tokens, max_len=max_len, cfg=cfg,
      options=StepOptions(verify=verify, measure_arr=True), seed=seed, token_block=token_block,
      on_output=meter)
  return tokens, stats, meter


def text_prompt(tok, text: str, ctx: int, rng) -> tuple[list[int], int]:
  """(the first `ctx` tokens, char offset) of `text` from a line start drawn
  by `rng`, drawing again where the span there encodes to fewer tokens."""
  span = ctx * 8
  while True:
    off = int(rng.integers(0, max(1, len(text) - span)))
    off = text.find("\n", off) + 1
    ids = tok.encode(text[off:off + span])
    if len(ids) >= ctx:
      return ids[:ctx], off
