"""From an ml_collections run config to models, prompts and a SpecConfig.

Shared by scripts/decode.py and the benchmark and evaluation scripts, so a
config means the same thing everywhere. Every check runs before any weight
is loaded: a bad config fails in a second with one message.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from dustin_jax.config import ConfigError, ModelConfig
from dustin_jax.generate import Model
from dustin_jax.sampling import SamplingConfig
from dustin_jax.spec.step import DRAFT_KV_MODES, SpecConfig

POLICIES = ("full", "dustin", "dustin_target", "dustin_draft", "streaming", "quest", "oracle")


def _plain(x):
  return x.to_dict() if hasattr(x, "to_dict") else x


def validate(c) -> None:
  """One clear ConfigError for the first thing wrong with a run config."""
  def need(ok, msg):
    if not ok:
      raise ConfigError(msg)
  need(c.method in ("speculative", "vanilla"),
       f"method must be 'speculative' or 'vanilla', got {c.method!r}")
  need(c.gamma >= 1, f"gamma must be >= 1, got {c.gamma}")
  need(c.dtype in ("bfloat16", "float32"), f"dtype must be bfloat16 or float32, got {c.dtype!r}")
  need(c.draft_kv in DRAFT_KV_MODES, f"draft_kv must be one of {DRAFT_KV_MODES}, got {c.draft_kv!r}")
  need(c.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {c.max_new_tokens}")
  need(c.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {c.prefill_chunk}")
  d = c.dustin
  need(d.policy in POLICIES, f"dustin.policy must be one of {POLICIES}, got {d.policy!r}")
  if d.policy != "full":
    # (the policy checks the values it resolves from the SRH file and defaults)
    if None not in (d.budget, d.n_sink, d.n_window):
      need(d.budget >= d.n_sink + d.n_window,
           f"dustin.budget={d.budget} is smaller than dustin.n_sink + dustin.n_window = "
           f"{d.n_sink} + {d.n_window}: raise the budget or shrink the sink/window")
      need(d.m is None or 0 <= d.m <= d.budget - d.n_sink - d.n_window,
           f"dustin.m={d.m} must lie in [0, budget - n_sink - n_window = "
           f"{d.budget - d.n_sink - d.n_window}]")
    if d.srh_file:
      need(os.path.isfile(d.srh_file), f"dustin.srh_file {d.srh_file!r} does not exist")
  sources = [x for x in (c.prompt, c.prompt_file, c.prompts_jsonl) if x]
  need(len(sources) <= 1, "set at most one of prompt, prompt_file, prompts_jsonl")
  for f in (c.prompt_file, c.prompts_jsonl):
    need(not f or os.path.isfile(f), f"prompt file {f!r} does not exist")
  roles = ("target",) if c.method == "vanilla" else ("target", "draft")
  for role in roles:
    m = c[role]
    if c.random_weights:
      need(m.hf_config is not None, f"{role}.hf_config is needed for random_weights=True")
    else:
      need(bool(m.asset) != bool(m.checkpoint),
           f"{role}: set exactly one of {role}.asset (an offline model) or {role}.checkpoint "
           "(or random_weights=True with hf_config)")
      need(not m.checkpoint or os.path.exists(m.checkpoint),
           f"{role}.checkpoint {m.checkpoint!r} does not exist")
  if not c.random_weights:
    need(bool(sources), "set prompt, prompt_file or prompts_jsonl (random_weights runs use "
         "random prompts)")


def _checkpoint_path(m, c) -> str:
  if m.asset:
    from dustin_jax.assets import ensure_model
    return str(ensure_model(m.asset, progress=c.progress))
  return m.checkpoint


def model_config(m, c) -> ModelConfig:
  """The model's config alone (memory planning before any allocation)."""
  layers = m.num_layers or None
  if c.random_weights:
    return ModelConfig.from_hf(_plain(m.hf_config), dtype=c.dtype, num_layers=layers)
  path = _checkpoint_path(m, c)
  if path.endswith(".gguf"):
    from dustin_jax.gguf_file import read_gguf_config
    return ModelConfig.from_hf(read_gguf_config(path), dtype=c.dtype, num_layers=layers)
  if os.path.isfile(os.path.join(path, "dustin_config.json")):
    from dustin_jax.weights import restore_params
    return restore_params(path)[0]
  return ModelConfig.from_hf(path, dtype=c.dtype, num_layers=layers)


def load_model(m, c, role: str, mesh=None) -> tuple[Model, str | None]:
  """(Model, path the tokenizer comes from or None), sharded over `mesh`
  with KV heads replicated where the model axis needs it (the draft: whole
  on every device, `sharding.draft_mesh`)."""
  from dustin_jax import sharding, weights
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
    cfg, graphdef, state = sharding.place_model(cfg, graphdef, state, mesh)
  return Model(cfg, graphdef, state), path


def make_mesh(c):
  """The device mesh of a run (multi-host: initialises jax.distributed)."""
  import jax
  from dustin_jax import sharding
  if c.mesh.distributed:
    jax.distributed.initialize()
  return sharding.make_mesh(c.mesh.data, c.mesh.model)


def plan_memory(c, mesh, target_cfg, draft_cfg):
  """Print the per-device memory plan and refuse what cannot fit."""
  from dustin_jax import sharding
  cap = int(c.mesh.device_memory_gib * 2**30) or sharding.device_capacity()
  plan = sharding.memory_plan(target_cfg, draft_cfg, batch=c.batch_size if c.random_weights
                              else len(prompt_texts(c)), max_len=c.max_len,
                              data=mesh.shape["data"], model=mesh.shape["model"], gamma=c.gamma,
                              capacity=cap)
  print(plan.table(), flush=True)
  sharding.check_fits(plan)
  return plan


def load_tokenizer(path: str):
  if path.endswith(".gguf"):
    from dustin_jax.assets import load_tokenizer as from_gguf
    return from_gguf(path)
  from transformers import AutoTokenizer
  try:
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise ConfigError(f"no tokenizer could be loaded from {path!r}: {e}") from None


def prompt_texts(c) -> list[str]:
  if c.prompt:
    return [c.prompt]
  if c.prompt_file:
    with open(c.prompt_file) as f:
      return [f.read()]
  texts = []
  with open(c.prompts_jsonl) as f:
    for i, line in enumerate(f):
      if line.strip():
        rec = json.loads(line)
        if "prompt" not in rec:
          raise ConfigError(f"{c.prompts_jsonl}:{i + 1}: a JSON object with key 'prompt' expected")
        texts.append(rec["prompt"])
  return texts


def encode_prompts(tokenizer, texts, chat: bool) -> list[list[int]]:
  out = []
  for t in texts:
    if chat:
      if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("chat_template=True but the tokenizer has no chat template")
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
  if c.dustin.policy == "full":
    from dustin_jax.selection.base import FullCache
    return FullCache()
  from dustin_jax.selection.policies import policy_from_config
  return policy_from_config(c.dustin, target, draft)


def spec_config(c, policy, eos: tuple[int, ...], mesh=None) -> SpecConfig:
  return SpecConfig(gamma=c.gamma, sampling=sampling_config(c), eos_ids=eos, policy=policy,
                    draft_kv=c.draft_kv, draft_sink=c.draft_sink, draft_window=c.draft_window,
                    impl=c.impl, mesh=mesh)


def sampling_config(c) -> SamplingConfig:
  try:
    return SamplingConfig(temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def build(c) -> dict[str, Any]:
  """Validate, plan memory, load models (sharded) and tokenizer, encode prompts."""
  validate(c)
  sampling_config(c)
  from dustin_jax import sharding
  mesh = make_mesh(c)
  speculative = c.method == "speculative"
  batch = c.batch_size if c.random_weights else len(prompt_texts(c))
  sharding.check_batch(mesh, batch)
  plan = plan_memory(c, mesh, model_config(c.target, c),
                     model_config(c.draft, c) if speculative else None)
  target, tok_path = load_model(c.target, c, "target", mesh)
  draft = load_model(c.draft, c, "draft", mesh)[0] if speculative else None
  tokenizer = load_tokenizer(tok_path) if tok_path else None
  if tokenizer is not None:
    prompts = encode_prompts(tokenizer, prompt_texts(c), c.chat_template)
    vocab = len(tokenizer)
    for role, m in (("target", target), ("draft", draft)):
      if m is not None and m.cfg.vocab_size < vocab:
        raise ConfigError(f"{role} vocab_size={m.cfg.vocab_size} is smaller than the "
                          f"tokenizer's {vocab} tokens: wrong model or tokenizer")
  else:
    vocab = min(target.cfg.vocab_size, draft.cfg.vocab_size if draft else target.cfg.vocab_size)
    prompts = random_prompts(c, vocab)
  eos = eos_ids(tokenizer, target.cfg)
  if speculative:
    policy = make_policy(c, target.cfg, draft.cfg)
  else:  # plain decoding verifies nothing
    from dustin_jax.selection.base import FullCache
    policy = FullCache()
  return dict(target=target, draft=draft, tokenizer=tokenizer, prompts=prompts, eos=eos,
              spec=spec_config(c, policy, eos, mesh), mesh=mesh, memory_plan=plan)
