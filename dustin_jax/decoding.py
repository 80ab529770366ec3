"""The types every decode shares: the model handle, per-sequence decode
state and stop control, a step's output, and the run's statistics.

Conventions of plain and speculative decoding alike:
- the prefill puts `prompt[:-1]` into the cache; the last prompt token is the
  first *pending* token: emitted (or given) but not yet in any cache. Every
  step feeds the pending token first, so each step writes `n + 1` rows and
  commits exactly as many rows as it emits tokens;
- stop control (EOS, max new tokens) is per sequence; a finished sequence
  emits nothing and stops advancing its cache while the batch goes on.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dustin_jax.config import ModelConfig


class Model(NamedTuple):
  """A decoder as the jitted functions take it: `graphdef` is static."""
  cfg: ModelConfig
  graphdef: nnx.GraphDef
  state: nnx.State

  def with_folded_norms(self) -> "Model":
    """This model with each layer's RMSNorm weights multiplied into the
    projections they feed (`Decoder.fold_norm_weights`): the decode-time
    layout; checkpoints and the offline profiling keep the weights apart."""
    module = nnx.merge(self.graphdef, self.state)
    module.fold_norm_weights()
    return Model(self.cfg, *nnx.split(module))

  def with_draft_mlp(self, mode: str) -> "Model":
    """This model as a draft whose MLPs run as `mode` says (a resolved
    mode of `resolve_draft_mlp`)."""
    if mode not in DRAFT_MLPS[1:]:
      raise ValueError(f"with_draft_mlp takes a resolved draft_mlp, one of {DRAFT_MLPS[1:]}, "
                       f"got {mode!r}")
    if mode == "xla":
      return self
    module = nnx.merge(self.graphdef, self.state)
    if mode in ("seam", "seam_mosaic"):
      module.fuse_seams(attention="mosaic" if mode == "seam_mosaic" else "triton")
    else:
      module.stream_mlps(prefetch_next_layer=mode != "kernel")
    return Model(self.cfg, *nnx.split(module))

  def with_draft_head(self, head: str) -> "Model":
    """This model as a draft whose LM head is `head`: "native" (its own
    matrix, in its dtype) or "int8" (`Decoder.quantize_head`: int8 rows
    with per-row scales, half the bytes a draft pass reads there)."""
    if head not in DRAFT_HEADS:
      raise ValueError(f"draft_head must be one of {DRAFT_HEADS}, got {head!r}")
    if head == "native":
      return self
    module = nnx.merge(self.graphdef, self.state)
    module.quantize_head()
    return Model(self.cfg, *nnx.split(module))


DRAFT_MLPS = ("auto", "xla", "kernel", "kernel_prefetch", "seam", "seam_mosaic")
DRAFT_HEADS = ("native", "int8")


def resolve_draft_mlp(mode: str, cfg: ModelConfig, mesh=None) -> str:
  """How a draft's MLPs run: "kernel" (one kernel per layer pass,
  `kernels.swiglu_mlp`: a Hopper GPU, one device, hidden size a multiple of
  128, intermediate size of 64, bf16 / f16), "kernel_prefetch" (that
  kernel, which also sends the next layer's q/k/v and o to L2), "seam"
  (a streaming draft's o, MLP and next q/k/v as one resident kernel per
  layer-pass, `kernels.layer_seam`; the same conditions), "seam_mosaic"
  (the seam with the pass's attention as a Mosaic GPU kernel that writes
  the seam's rows, `window_attention_rows`) or "xla" (its GEMMs); "auto":
  "kernel_prefetch" wherever the kernel can run."""
  from kernels.common import is_hopper
  if mode not in DRAFT_MLPS:
    raise ValueError(f"draft_mlp must be one of {DRAFT_MLPS}, got {mode!r}")
  shapes_fit = (cfg.hidden_size % 128 == 0 and cfg.intermediate_size % 64 == 0
                and cfg.dtype in ("bfloat16", "float16"))
  one_device = mesh is None or mesh.devices.size == 1
  if mode == "auto":
    return "kernel_prefetch" if shapes_fit and one_device and is_hopper() else "xla"
  if mode != "xla" and not (shapes_fit and one_device):
    raise ValueError(
        f"draft_mlp={mode!r} runs on one device with hidden_size % 128 == 0, "
        f"intermediate_size % 64 == 0 and a 16-bit dtype; this draft has hidden_size="
        f"{cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, dtype={cfg.dtype}"
        f"{'' if one_device else ' and a mesh of several devices'}: use 'xla' or 'auto'")
  return mode


class InputError(ValueError):
  """Inputs that cannot be decoded as asked (too long, empty, ...)."""


def check_lengths(prompt_lengths: Sequence[int], max_new_tokens: int, max_len: int,
                  block: int = 1) -> None:
  """One clear error before any work if a sequence cannot fit its cache."""
  if not prompt_lengths or min(prompt_lengths) < 1:
    raise InputError("every prompt needs at least one token")
  need = max(prompt_lengths) - 1 + max_new_tokens + block
  if need > max_len:
    raise InputError(
        f"prompt of {max(prompt_lengths)} tokens + {max_new_tokens} new tokens "
        f"(+{block} rows of work space) needs a cache of {need} rows, but max_len is "
        f"{max_len}: raise max_len, shorten the prompt or generate fewer tokens")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  pending: jax.Array        # int32[B] last token, not yet in the caches
  prev: jax.Array           # int32[B] the token before it (the last cache row)
  num_generated: jax.Array  # int32[B]
  max_new: jax.Array        # int32[B]
  done: jax.Array           # bool[B]
  rng: jax.Array

  @classmethod
  def init(cls, prompts, max_new_tokens, rng) -> "DecodeState":
    pending = jnp.asarray([p[-1] for p in prompts], jnp.int32)
    prev = jnp.asarray([p[-2] if len(p) > 1 else -1 for p in prompts], jnp.int32)
    b = pending.shape[0]
    max_new = jnp.broadcast_to(jnp.asarray(max_new_tokens, jnp.int32), (b,))
    return cls(pending=pending, prev=prev, num_generated=jnp.zeros((b,), jnp.int32),
               max_new=max_new, done=max_new <= 0, rng=rng)


def emit(ds: DecodeState, tokens: jax.Array, n_valid: jax.Array,
         eos_ids: tuple[int, ...]):
  """Emit up to `n_valid[b]` of `tokens[B, n]`, cut after the first EOS and
  at the sequence's max-new budget; nothing for finished sequences.

  Returns (state, tokens with -1 where not emitted, number emitted[B]).
  """
  b, n = tokens.shape
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  is_eos = jnp.zeros(tokens.shape, bool)
  for e in eos_ids:
    is_eos |= tokens == e
  first_eos = jnp.min(jnp.where(is_eos & (pos < n_valid[:, None]), pos, n), axis=1)
  count = jnp.minimum(n_valid, first_eos + 1)
  count = jnp.minimum(count, ds.max_new - ds.num_generated)
  count = jnp.where(ds.done, 0, count).astype(jnp.int32)
  out = jnp.where(pos < count[:, None], tokens, -1)
  at = lambda i: jnp.take_along_axis(tokens, jnp.maximum(i, 0)[:, None], axis=1)[:, 0]
  last, before_last = at(count - 1), at(count - 2)
  hit_eos = first_eos < count
  num_generated = ds.num_generated + count
  ds = dataclasses.replace(
      ds,
      pending=jnp.where(count > 0, last, ds.pending),
      prev=jnp.where(count > 1, before_last, jnp.where(count == 1, ds.pending, ds.prev)),
      num_generated=num_generated,
      done=ds.done | hit_eos | (num_generated >= ds.max_new))
  return ds, out, count


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one decoding step hands the host (plain decoding: gamma = 0).

  The optional fields are None unless the step was asked for them
  (`speculative.StepOptions`)."""
  tokens: jax.Array            # int32[B, gamma+1], -1 where nothing was emitted
  n_emitted: jax.Array         # int32[B]
  n_accepted: jax.Array        # int32[B] draft tokens accepted (0 for inactive sequences)
  active: jax.Array            # bool[B] sequence was unfinished at step start
  done: jax.Array              # bool[B] sequence is finished after this step
  kv_indices: jax.Array | None = None     # int32[B, K] the verification set (None: full cache)
  arr: jax.Array | None = None            # f32[B] attention recovery rate of kv_indices
  arr_per_layer: jax.Array | None = None  # f32[B, L]
  nll: jax.Array | None = None            # f32[B, gamma+1] of forced tokens (teacher forcing)
  target_top1: jax.Array | None = None    # int32[B, gamma+1] the target's argmax (teacher forcing)


@dataclasses.dataclass
class DecodeStats:
  """Counters and wall times of one decode run (plain decoding: gamma = 0,
  tau = 1). `compile_s` is XLA compile time spent inside the prefill and the
  decode loop (already part of `prefill_s` / `decode_s`)."""
  steps: int = 0
  tokens: int = 0              # emitted, all sequences
  seq_steps: int = 0           # (sequence, step) pairs with the sequence active
  accepted: int = 0            # accepted draft tokens over those pairs
  gamma: int = 0
  prompt_tokens: int = 0       # prefilled, all sequences
  prefill_s: float = 0.0
  decode_s: float = 0.0
  first_step_s: float = 0.0    # decode start to the first step's tokens on the host
  prefill_compile_s: float = 0.0
  decode_compile_s: float = 0.0

  @property
  def tau(self) -> float:
    """Mean tokens per verification: accepted drafts + 1."""
    return (self.accepted + self.seq_steps) / max(self.seq_steps, 1)

  @property
  def acceptance_rate(self) -> float:
    return self.accepted / max(self.seq_steps * self.gamma, 1) if self.gamma else 0.0

  @property
  def compile_s(self) -> float:
    return self.prefill_compile_s + self.decode_compile_s

  @property
  def tokens_per_s(self) -> float:
    """Decode tokens/s, compile time excluded."""
    t = self.decode_s - self.decode_compile_s
    return self.tokens / t if t > 0 else 0.0

  @property
  def prefill_tokens_per_s(self) -> float:
    """Prefill tokens/s, compile time excluded."""
    t = self.prefill_s - self.prefill_compile_s
    return self.prompt_tokens / t if t > 0 else 0.0

  def record(self, n_emitted, active, n_accepted=None) -> int:
    """Count one step: per-sequence emitted tokens, active flags (or their
    count) and accepted draft tokens. Returns the tokens emitted."""
    self.steps += 1
    self.tokens += int(np.sum(n_emitted))
    self.seq_steps += int(np.sum(active))
    if n_accepted is not None:
      self.accepted += int(np.sum(n_accepted))
    return int(np.sum(n_emitted))

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, compile_s=self.compile_s,
             tokens_per_s=self.tokens_per_s, prefill_tokens_per_s=self.prefill_tokens_per_s)
    return d


def collect(out_tokens: list[np.ndarray]) -> list[list[int]]:
  """Concatenate per-step emitted tokens [B, n] (-1 = none) per sequence."""
  if not out_tokens:
    return []
  allt = np.concatenate(out_tokens, axis=1)
  return [[int(t) for t in row if t >= 0] for row in allt]
