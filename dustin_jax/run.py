"""From an ml_collections run config to models, prompts and a SpecConfig.

Shared by scripts/decode.py and the benchmark and evaluation scripts, so a
config means the same thing everywhere. Every check runs before any weight
is loaded: the config's values, the prompt files, the model configs and
checkpoint headers, the tokenizer, the prompts' lengths and the policy. A
bad run fails in seconds with one message that names the input and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from dustin_jax import sharding, weights
from dustin_jax.assets import MODELS, AssetError, ensure_model
from dustin_jax.assets import load_tokenizer as gguf_tokenizer
from dustin_jax.config import CheckpointError, ConfigError, ModelConfig
from dustin_jax.decoding import (DRAFT_HEADS, DRAFT_MLPS, InputError, Model, check_lengths,
                                 resolve_draft_mlp)
from dustin_jax.gguf_file import read_gguf_config
from dustin_jax.models.prefill import bucket_len
from dustin_jax.sampling import SamplingConfig
from dustin_jax.selection.base import FullCache
from dustin_jax.selection.policies import POLICIES as policy_registry
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.selection.srh import load_srh
from dustin_jax.speculative.engine import check_pair
from dustin_jax.speculative.step import DRAFT_KV_MODES, SpecConfig

# what a run's inputs can cause (each message names the input and the fix);
# anything else is a bug and keeps its traceback
USER_ERRORS = (ConfigError, InputError, CheckpointError, AssetError)

POLICIES = tuple(policy_registry)
IMPLS = ("auto", "reference", "gpu", "tpu")
# the files one of which a Hugging Face tokenizer directory holds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
JSONL_EXAMPLE = '{"prompt": "..."}'
# the config's choices and lower bounds, checked first
ONE_OF = (("method", ("speculative", "vanilla")), ("dtype", ("bfloat16", "float32")),
          ("impl", IMPLS), ("draft_kv", DRAFT_KV_MODES), ("draft_mlp", DRAFT_MLPS),
          ("draft_head", DRAFT_HEADS))
AT_LEAST = (("gamma", 1), ("max_new_tokens", 1), ("max_len", 2), ("prefill_block", 1),
            ("seed", 0))


def _plain(x):
  return x.to_dict() if hasattr(x, "to_dict") else x


def _need(ok, msg):
  if not ok:
    raise ConfigError(msg)


def validate(c) -> None:
  """One clear ConfigError for the first thing wrong with a run config
  (values and paths only: nothing is read but the SRH file)."""
  for field, choices in ONE_OF:
    _need(c[field] in choices, f"{field} must be one of {choices}, got {c[field]!r}")
  for field, least in AT_LEAST:
    _need(c[field] >= least, f"{field} must be >= {least}, got {c[field]}")
  speculative = c.method == "speculative"
  _need(c.draft_sink >= 0 and c.draft_window >= 0 and c.draft_sink + c.draft_window >= 1,
        f"draft_sink={c.draft_sink} and draft_window={c.draft_window} must be >= 0, with a sum "
        ">= 1")
  d = c.selection
  _need(d.policy in POLICIES, f"selection.policy must be one of {POLICIES}, got {d.policy!r}")
  if speculative and d.policy != "full":
    # (the policy checks the values it resolves from the SRH file and defaults)
    if None not in (d.budget, d.n_sink, d.n_window):
      _need(d.budget >= d.n_sink + d.n_window,
            f"selection.budget={d.budget} is smaller than selection.n_sink + selection.n_window "
            f"= {d.n_sink} + {d.n_window}: raise the budget or shrink the sink/window")
      _need(d.m is None or 0 <= d.m <= d.budget - d.n_sink - d.n_window,
            f"selection.m={d.m} must lie in [0, budget - n_sink - n_window = "
            f"{d.budget - d.n_sink - d.n_window}]")
    if d.srh_file:
      _check_file(d.srh_file, "selection.srh_file")
      try:
        load_srh(d.srh_file)  # its format now; its heads against the models later
      except UnicodeDecodeError:
        raise ConfigError(f"selection.srh_file {d.srh_file!r} is not UTF-8 text: give the JSON "
                          "written by scripts/profile_srh.py") from None
  sources = [k for k in ("prompt", "prompt_file", "prompts_jsonl") if c[k]]
  _need(len(sources) <= 1, f"set at most one of prompt, prompt_file, prompts_jsonl (set: "
        f"{', '.join(sources)})")
  for k in ("prompt_file", "prompts_jsonl"):
    if c[k]:
      _check_file(c[k], k)
  for role in ("target", "draft") if speculative else ("target",):
    m = c[role]
    _need(m.num_layers >= 0, f"{role}.num_layers must be >= 0 (0 keeps every layer), got "
          f"{m.num_layers}")
    if c.random_weights:
      _need(m.hf_config is not None, f"{role}.hf_config is needed for random_weights=True")
      _need(not m.asset and not m.checkpoint,
            f"{role}.{'asset' if m.asset else 'checkpoint'} is set, but random_weights=True "
            f"builds random weights of {role}.hf_config and would ignore it: set "
            "--config.random_weights=False to load it")
      continue
    _need(bool(m.asset) != bool(m.checkpoint),
          f"{role}: set exactly one of {role}.asset (an offline model) or {role}.checkpoint "
          "(or random_weights=True with hf_config)")
    if m.asset:
      _need(m.asset in MODELS, f"{role}.asset {m.asset!r} is not a known model: choose one of "
            f"{', '.join(sorted(MODELS))}")
    else:
      _need(os.path.exists(m.checkpoint), f"{role}.checkpoint {m.checkpoint!r} does not exist")
      _need(os.path.isdir(m.checkpoint) or m.checkpoint.endswith(".gguf"),
            f"{role}.checkpoint {m.checkpoint!r} is neither a directory nor a .gguf file: give "
            "a Hugging Face or orbax checkpoint directory, or a .gguf file")
  if c.random_weights:
    ignored = sources + (["chat_template"] if c.chat_template else [])
    _need(not ignored, f"random_weights=True decodes random token prompts (batch_size x "
          f"prompt_len) without a tokenizer, so {' and '.join(ignored)} would be ignored: drop "
          "it, or set random_weights=False with real checkpoints")
    _need(c.batch_size >= 1, f"batch_size must be >= 1, got {c.batch_size}")
    least = 2 if speculative else 1
    _need(c.prompt_len >= least, f"prompt_len must be >= {least} "
          f"{'(speculative decoding re-feeds the last prompt token), ' if speculative else ''}"
          f"got {c.prompt_len}")
  else:
    _need(bool(sources), "set prompt, prompt_file or prompts_jsonl (random_weights runs use "
          "random prompts)")
  if not c.mesh.distributed:  # there, the backend may start only after jax.distributed
    check_impl(c)


def check_impl(c) -> None:
  """impl=gpu / impl=tpu only where JAX runs on that backend."""
  if c.impl not in ("gpu", "tpu"):
    return
  backend = jax.default_backend()
  ok = backend in ("gpu", "cuda", "rocm") if c.impl == "gpu" else backend == "tpu"
  if not ok:
    raise ConfigError(f"impl={c.impl!r} runs Pallas kernels for a {c.impl.upper()}, but JAX "
                      f"runs on {backend!r} here: set --config.impl=auto (or reference)")


def _check_file(path: str, field: str) -> None:
  if os.path.isdir(path):
    raise ConfigError(f"{field} {path!r} is a directory: give the path of a file")
  if not os.path.isfile(path):
    raise ConfigError(f"{field} {path!r} does not exist")


def _checkpoint_path(m, c) -> str:
  if m.asset:
    return str(ensure_model(m.asset, progress=c.progress))
  return m.checkpoint


def model_config(m, c, role: str = "model") -> ModelConfig:
  """The model's config alone (memory planning before any allocation), with
  `num_layers` checked against the depth of the config or checkpoint."""
  if c.random_weights:
    full, source = ModelConfig.from_hf(_plain(m.hf_config), dtype=c.dtype), f"{role}.hf_config"
  else:
    source = _checkpoint_path(m, c)
    if source.endswith(".gguf"):
      with weights.gguf_errors(source):
        hf = read_gguf_config(source)
      full = ModelConfig.from_hf(hf, dtype=c.dtype)
    elif os.path.isfile(os.path.join(source, "dustin_config.json")):
      full = weights.saved_config(source)
      if m.num_layers and m.num_layers != full.num_layers:
        raise ConfigError(f"{role}.num_layers={m.num_layers}, but the orbax checkpoint {source!r} "
                          f"is restored whole ({full.num_layers} layers): set {role}.num_layers=0")
    else:
      full = ModelConfig.from_hf(source, dtype=c.dtype)
  if m.num_layers > full.num_layers:
    raise ConfigError(f"{role}.num_layers={m.num_layers}, but {source} has {full.num_layers} "
                      f"layers: set {role}.num_layers to at most {full.num_layers} (0 keeps "
                      "them all)")
  return full.replace(num_layers=m.num_layers) if m.num_layers else full


def load_model(m, c, role: str, mesh=None) -> tuple[Model, str | None]:
  """(Model, path the tokenizer comes from or None), sharded over `mesh`
  with KV heads replicated where the model axis needs it (the draft: whole
  on every device, `sharding.draft_mesh`), its norm weights folded into the
  projections (`Model.with_folded_norms`)."""
  if role == "draft":
    mesh = sharding.draft_mesh(mesh)
  layers = m.num_layers or None
  path = None
  if c.random_weights:
    cfg = ModelConfig.from_hf(_plain(m.hf_config), dtype=c.dtype, num_layers=layers)
    graphdef, state = weights.random_params(cfg, seed=c.seed + (role == "draft"), mesh=mesh)
  else:
    path = _checkpoint_path(m, c)
    cfg, graphdef, state = weights.load_checkpoint(path, dtype=c.dtype, num_layers=layers,
                                                   mesh=mesh)
  if mesh is not None:
    cfg, graphdef, state = weights.place_model(cfg, graphdef, state, mesh)
  return Model(cfg, graphdef, state).with_folded_norms(), path


def check_checkpoint(m, c, cfg: ModelConfig) -> None:
  """A Hugging Face checkpoint directory's tensors: each one the model needs
  present, of its shape and inside its file (headers only, no weights)."""
  if c.random_weights:
    return
  path = _checkpoint_path(m, c)
  if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "dustin_config.json")):
    weights.check_hf_checkpoint(path, cfg)


def make_mesh(c):
  """The device mesh of a run (multi-host: initialises jax.distributed)."""
  if c.mesh.distributed:
    jax.distributed.initialize()
  return sharding.make_mesh(c.mesh.data, c.mesh.model)


def plan_memory(c, mesh, target_cfg, draft_cfg, batch: int, prompt_len: int):
  """Print the per-device memory plan and refuse what cannot fit."""
  cap = int(c.mesh.device_memory_gib * 2**30) or sharding.device_capacity()
  plan = sharding.memory_plan(target_cfg, draft_cfg, batch=batch, max_len=c.max_len,
                              data=mesh.shape["data"], model=mesh.shape["model"], gamma=c.gamma,
                              capacity=cap, prompt_len=prompt_len, token_block=c.prefill_block,
                              draft_int8_head=c.draft_head == "int8")
  print(plan.table(), flush=True)
  try:
    sharding.check_fits(plan)
  except ConfigError as e:  # the table is printed above: the message stays one line
    raise ConfigError(" ".join(str(e).replace(plan.table(), "(plan above);").split())) from None
  return plan


def load_tokenizer(path: str):
  """The tokenizer of a .gguf file or of a Hugging Face checkpoint
  directory, refused where it has no tokens."""
  if path.endswith(".gguf"):
    return gguf_tokenizer(path)
  if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
    raise ConfigError(f"checkpoint {path!r} has no tokenizer (none of "
                      f"{', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files into it")
  from transformers import AutoTokenizer  # (heavy: only for Hugging Face checkpoints)
  try:
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise ConfigError(f"no tokenizer could be loaded from {path!r}: {e}") from None
  if len(tok) == 0:
    raise ConfigError(f"the tokenizer of {path!r} has no tokens (its vocabulary files are "
                      "missing or empty): copy the model's tokenizer files into it")
  return tok


def prompt_texts(c) -> list[str]:
  """The prompts of `prompt`, `prompt_file` or `prompts_jsonl`, each one
  checked: readable UTF-8, well-formed, not empty."""
  if c.prompt:
    texts, where = [c.prompt], ["prompt"]
  elif c.prompt_file:
    texts, where = [_read_text(c.prompt_file)], [f"prompt_file {c.prompt_file!r}"]
  else:
    texts, where = _read_jsonl(c.prompts_jsonl)
    if not texts:
      raise ConfigError(f"prompts_jsonl {c.prompts_jsonl!r} has no prompts: write one JSON "
                        f"object per line, e.g. {JSONL_EXAMPLE}")
  for text, w in zip(texts, where):
    if not text.strip():
      raise ConfigError(f"{w}: the prompt is empty: give the text to continue or answer")
  return texts


def _read_bytes(path: str, field: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise ConfigError(f"{field} {path!r} cannot be read: {e.strerror}") from None


def _read_text(path: str) -> str:
  data = _read_bytes(path, "prompt_file")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.start}): save the file as "
                      "UTF-8") from None


def _read_jsonl(path: str) -> tuple[list[str], list[str]]:
  """(prompts, "file:line" of each) of a JSONL file of {"prompt": ...}."""
  lines = _read_bytes(path, "prompts_jsonl").split(b"\n")
  texts, where = [], []
  for i, raw in enumerate(lines, 1):
    at = f"{path}:{i}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ConfigError(f"{at}: not UTF-8 text (column {e.start + 1}): save the file as "
                        "UTF-8") from None
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{at}: not valid JSON ({e.msg}, column {e.colno}): each line must "
                        f"be one JSON object, e.g. {JSONL_EXAMPLE}") from None
    if not isinstance(rec, dict) or "prompt" not in rec:
      got = "an object without 'prompt'" if isinstance(rec, dict) else f"a {type(rec).__name__}"
      raise ConfigError(f"{at}: expected a JSON object with key 'prompt', e.g. {JSONL_EXAMPLE}, "
                        f"got {got}")
    if not isinstance(rec["prompt"], str):
      raise ConfigError(f"{at}: 'prompt' must be a string, got {type(rec['prompt']).__name__} "
                        f"{rec['prompt']!r}: quote the text")
    texts.append(rec["prompt"])
    where.append(at)
  return texts, where


def encode_prompts(tokenizer, texts, chat: bool, source: str = "the tokenizer"
                   ) -> list[list[int]]:
  out = []
  for t in texts:
    if chat:
      if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"chat_template=True but {source} has no chat template: set "
                          "--config.chat_template=False")
      ids = tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                          add_generation_prompt=True, tokenize=True)
      ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
      ids = tokenizer(t)["input_ids"]
    out.append([int(i) for i in ids])
  return out


def random_prompts(c, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(c.seed)
  return [rng.integers(0, vocab, size=c.prompt_len).tolist() for _ in range(c.batch_size)]


def check_prompts(c, prompts) -> None:
  """Each encoded prompt fits the decode: long enough, and within max_len."""
  if c.method == "speculative" and min(len(p) for p in prompts) < 2:
    raise InputError("speculative decoding needs prompts of at least 2 tokens; one encodes to "
                     f"{min(len(p) for p in prompts)}: give a longer prompt or use "
                     "method=vanilla")
  block = c.gamma + 1 if c.method == "speculative" else 1
  check_lengths([len(p) for p in prompts], c.max_new_tokens, c.max_len, block=block)


def eos_ids(tokenizer, cfg: ModelConfig) -> tuple[int, ...]:
  ids = set(cfg.eos_token_ids)
  if tokenizer is not None:
    for tok in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
      i = tokenizer.convert_tokens_to_ids(tok)
      if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
        ids.add(i)
    if tokenizer.eos_token_id is not None:
      ids.add(int(tokenizer.eos_token_id))
  return tuple(sorted(ids))


def make_policy(c, target: ModelConfig, draft: ModelConfig | None):
  if c.selection.policy == "full":
    return FullCache()
  return policy_from_config(c.selection, target, draft)


def spec_config(c, policy, eos: tuple[int, ...], mesh=None) -> SpecConfig:
  return SpecConfig(gamma=c.gamma, sampling=sampling_config(c), eos_ids=eos, policy=policy,
                    draft_kv=c.draft_kv, draft_sink=c.draft_sink, draft_window=c.draft_window,
                    impl=c.impl, mesh=mesh)


def sampling_config(c) -> SamplingConfig:
  try:
    return SamplingConfig(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
  except ValueError as e:
    raise ConfigError(str(e)) from None


@dataclasses.dataclass
class Run:
  """What a run config builds: the placed models, the tokenizer (None for
  random weights), the encoded prompts and the step's settings."""
  target: Model
  draft: Model | None
  tokenizer: Any
  prompts: list[list[int]]
  eos: tuple[int, ...]
  spec: SpecConfig
  mesh: Any
  memory_plan: Any


def build(c) -> Run:
  """Validate, plan memory, load models (sharded) and tokenizer, encode prompts.

  Everything but the weights is read and checked first (prompt files, model
  configs, checkpoint headers, tokenizer, prompt lengths, the policy)."""
  validate(c)
  sampling_config(c)
  texts = None if c.random_weights else prompt_texts(c)
  mesh = make_mesh(c)
  check_impl(c)
  speculative = c.method == "speculative"
  batch = c.batch_size if c.random_weights else len(texts)
  sharding.check_batch(mesh, batch)
  target_cfg = model_config(c.target, c, "target")
  draft_cfg = model_config(c.draft, c, "draft") if speculative else None
  cfgs = [("target", target_cfg)] + ([("draft", draft_cfg)] if speculative else [])
  tokenizer = None
  if c.random_weights:
    prompts = random_prompts(c, min(cfg.vocab_size for _, cfg in cfgs))
  else:
    tok_path = _checkpoint_path(c.target, c)
    tokenizer = load_tokenizer(tok_path)
    prompts = encode_prompts(tokenizer, texts, c.chat_template, f"the tokenizer of {tok_path!r}")
    vocab = len(tokenizer)
    for role, cfg in cfgs:
      if cfg.vocab_size < vocab:
        raise ConfigError(f"{role} vocab_size={cfg.vocab_size} is smaller than the "
                          f"tokenizer's {vocab} tokens: wrong model or tokenizer")
  check_prompts(c, prompts)
  if speculative:
    check_pair(target_cfg, draft_cfg)
    make_policy(c, target_cfg, draft_cfg)  # its checks now; built again for the placed models
    try:
      resolve_draft_mlp(c.draft_mlp, draft_cfg, mesh)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  for (role, cfg) in cfgs:
    check_checkpoint(c[role], c, cfg)
  plan = plan_memory(c, mesh, target_cfg, draft_cfg, batch,
                     prompt_len=bucket_len(max(len(p) for p in prompts), c.max_len))
  target, _ = load_model(c.target, c, "target", mesh)
  draft = load_model(c.draft, c, "draft", mesh)[0] if speculative else None
  if speculative:
    draft = draft.with_draft_mlp(resolve_draft_mlp(c.draft_mlp, draft.cfg, mesh))
    draft = draft.with_draft_head(c.draft_head)
  eos = eos_ids(tokenizer, target.cfg)
  # plain decoding verifies nothing
  policy = make_policy(c, target.cfg, draft.cfg) if speculative else FullCache()
  return Run(target=target, draft=draft, tokenizer=tokenizer, prompts=prompts, eos=eos,
             spec=spec_config(c, policy, eos, mesh), mesh=mesh, memory_plan=plan)

