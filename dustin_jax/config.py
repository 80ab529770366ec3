"""Model configuration: one frozen dataclass, built from a Hugging Face config.

Every way a model is described (a checkpoint's `config.json`, a GGUF file's
metadata, the paper-shape dicts under `configs/`) goes through
`ModelConfig.from_hf`, which validates what the decoder supports and refuses
the rest with one clear message.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import re
import types
from typing import Any, Mapping

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")
DTYPES = ("float32", "bfloat16")


# XLA launches a jitted step as one CUDA graph. Two settings of that graph,
# each added where this jaxlib knows it and the user has not set it:
# * the update mode: before each launch XLA re-records every command whose
#   buffers moved since the last one (~1900 commands, ~10 ms of host time
#   for the 7B + 0.5B speculative step). The bound steps write their results
#   in place (generate.BoundStep); SKIP_TEMP keeps the temporaries at fixed
#   addresses too, so the graph is launched as recorded
#   (results/h200/host_dispatch/). jaxlib 0.10 rejects it.
# * the scheduling mode: CONCURRENT records the data dependencies between
#   commands instead of one serial chain, so kernels that do not depend on
#   each other (the target-side scoring and the draft passes, for one) may
#   run side by side: 2% off the speculative step at 32k x 16
#   (results/h200/concurrent/).
GRAPH_FLAGS = (
    ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP", (0, 11, 2)),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", (0, 10, 2)),
)


def append_xla_flags(extra: str) -> None:
  """Append `extra` to XLA_FLAGS, after each of `GRAPH_FLAGS` that this
  jaxlib knows and whose option is not set already (setting the option is
  how to opt out). XLA reads the flags once, when JAX starts its backend:
  call this before anything touches a device.

  A command-buffer update mode other than ALWAYS_UPDATE allocates device
  memory through XLA's VMM allocator: XLA switches to it from any other
  with a warning on every start. So with such a mode this also asks for that
  allocator (XLA_PYTHON_CLIENT_ALLOCATOR=vmm) where no allocator is set."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip()
  jaxlib = _jaxlib_version()
  defaults = [flag for flag, since in GRAPH_FLAGS
              if jaxlib >= since and flag.split("=")[0] + "=" not in flags]
  flags = " ".join(defaults + ([flags] if flags else []))
  if flags:
    os.environ["XLA_FLAGS"] = flags
  modes = re.findall(r"--xla_gpu_command_buffer_update_mode=(\S+)", flags)
  if modes and modes[-1] != "ALWAYS_UPDATE":
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "vmm")


def _jaxlib_version() -> tuple[int, ...]:
  try:
    release = importlib.metadata.version("jaxlib").split("+")[0].split(".")
    return tuple(int(x) for x in release[:3] if x.isdigit())
  except importlib.metadata.PackageNotFoundError:
    return ()


class ConfigError(ValueError):
  """A model or run configuration that dustin_jax cannot serve."""


class CheckpointError(ValueError):
  """A checkpoint file that cannot be read, or that does not match the model
  it is loaded into (the message names the file and, where one is at fault,
  the tensor)."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float
  rope_type: str = "default"
  factor: float = 1.0
  # llama3
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  # yarn
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of one Llama-3 / Qwen2 decoder."""

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope: RopeConfig
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  o_bias: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 32768
  dtype: str = "bfloat16"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
    attn = d * (h + 2 * kv) * hd + h * hd * d
    if self.qkv_bias:
      attn += (h + 2 * kv) * hd
    mlp = 3 * d * self.intermediate_size
    per_layer = attn + mlp + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + emb + d

  def kv_bytes_per_token(self, bytes_per_el: int | None = None) -> int:
    if bytes_per_el is None:
      bytes_per_el = 4 if self.dtype == "float32" else 2
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_el

  # ------------------------------------------------------------------ loaders
  @classmethod
  def from_hf(cls, hf: Any, *, dtype: str = "bfloat16",
              num_layers: int | None = None) -> "ModelConfig":
    """From a transformers `PretrainedConfig`, a config dict, or a directory
    / `config.json` path. `num_layers` overrides the depth (benchmarks of
    paper shapes with fewer layers)."""
    hf = _as_hf_config(hf)
    get = lambda k, default=None: getattr(hf, k, default)
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
          f"unsupported architecture model_type={model_type!r}: dustin_jax "
          f"serves {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-3 family and "
          "Qwen2/Qwen2.5).")
    if dtype not in DTYPES:
      raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    act = get("hidden_act", "silu")
    if act != "silu":
      raise ConfigError(f"unsupported hidden_act={act!r} (only 'silu')")
    if get("mlp_bias", False):
      raise ConfigError("unsupported mlp_bias=True")
    if model_type == "qwen2" and get("use_sliding_window", False):
      raise ConfigError("unsupported use_sliding_window=True (Qwen2 sliding "
                        "window attention); every layer must attend fully")
    def num(k, default=None) -> int:
      v = get(k, default)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
        raise ConfigError(f"model config field {k}={v!r} must be a positive integer")
      return int(v)
    num_heads = num("num_attention_heads")
    num_kv = num("num_key_value_heads", None) if get("num_key_value_heads") else num_heads
    hidden = num("hidden_size")
    head_dim = num("head_dim") if get("head_dim") else hidden // num_heads
    if num_heads % num_kv:
      raise ConfigError(f"num_attention_heads={num_heads} is not a multiple of "
                        f"num_key_value_heads={num_kv}")
    eos = get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    depth = num("num_hidden_layers")
    if num_layers is not None and num_layers < 1:
      raise ConfigError(f"num_layers={num_layers} must be >= 1")
    return cls(
        model_type=model_type,
        vocab_size=num("vocab_size"),
        hidden_size=hidden,
        intermediate_size=num("intermediate_size"),
        num_layers=int(num_layers if num_layers is not None else depth),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rope=_rope_from_hf(hf),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(get("attention_bias", False)),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        dtype=dtype,
        bos_token_id=get("bos_token_id"),
        eos_token_ids=eos,
    )


# transformers' defaults of the fields `from_hf` reads that a config.json or
# dict may leave out (LlamaConfig / Qwen2Config): dicts and files are read
# without transformers, whose import (torch with it) costs seconds of load
_HF_DEFAULTS = {
    "llama": dict(hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False,
                  mlp_bias=False, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=10000.0, use_sliding_window=False),
}


def _as_hf_config(hf: Any):
  """The fields of a transformers config object, a dict, or a directory /
  config.json path, as attributes."""
  if isinstance(hf, Mapping):
    d = dict(hf)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(
          f"unsupported architecture model_type={model_type!r}: dustin_jax "
          f"serves {', '.join(SUPPORTED_MODEL_TYPES)}.")
    return types.SimpleNamespace(**{**_HF_DEFAULTS[model_type], **d})
  if not isinstance(hf, (str, os.PathLike)):
    return hf  # a transformers PretrainedConfig
  path = os.fspath(hf)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"no model config at {path!r} (expected a Hugging Face "
                      "checkpoint directory with config.json)")
  try:
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"model config {path!r} is not valid JSON ({e}): restore the "
                      "checkpoint's config.json") from None
  if not isinstance(d, dict):
    raise ConfigError(f"model config {path!r} is not a JSON object: restore the checkpoint's "
                      "config.json")
  return _as_hf_config(d)


def _rope_from_hf(hf) -> RopeConfig:
  params = dict(getattr(hf, "rope_parameters", None) or {})
  legacy = getattr(hf, "rope_scaling", None)  # transformers < 5
  if legacy:
    params = {**dict(legacy), **params}
  theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
  if theta is None:
    theta = 10000.0
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ConfigError(f"unsupported rope type {rope_type!r}; supported: "
                      f"{', '.join(SUPPORTED_ROPE_TYPES)}")
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError("unsupported partial_rotary_factor != 1")
  max_pos = int(getattr(hf, "max_position_embeddings", 32768))
  kw: dict[str, Any] = dict(theta=float(theta), rope_type=rope_type)
  if rope_type != "default":
    kw["original_max_position_embeddings"] = int(
        params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if factor is None:
      factor = max_pos / kw["original_max_position_embeddings"]
    kw["factor"] = float(factor)
  if rope_type == "llama3":
    kw.update(low_freq_factor=float(params.get("low_freq_factor", 1.0)),
              high_freq_factor=float(params.get("high_freq_factor", 4.0)))
  if rope_type == "yarn":
    for k in ("attention_factor", "mscale", "mscale_all_dim"):
      if params.get(k) is not None:
        kw[k] = float(params[k])
    kw.update(beta_fast=float(params.get("beta_fast") or 32.0),
              beta_slow=float(params.get("beta_slow") or 1.0),
              truncate=bool(params.get("truncate", True)))
  return RopeConfig(**kw)


def rope_inv_freq(cfg: ModelConfig):
  """Inverse frequencies [head_dim // 2] and the cos/sin scale (numpy f32)."""
  r, dim = cfg.rope, cfg.head_dim
  inv_freq = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  if r.rope_type == "default":
    return inv_freq.astype(np.float32), 1.0
  if r.rope_type == "llama3":
    old = r.original_max_position_embeddings
    low_wavelen = old / r.low_freq_factor
    high_wavelen = old / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  # yarn: blend interpolated and extrapolated frequencies by a linear ramp
  # over the dimensions whose wavelength lies between beta_slow and beta_fast
  # rotations of the original context.
  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  attn = r.attention_factor
  if attn is None:
    if r.mscale and r.mscale_all_dim:
      attn = mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
    else:
      attn = mscale(r.factor)
  def corr_dim(rot):
    return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(r.theta))
  low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
  if r.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = r.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv = (1.0 / (r.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
  return inv.astype(np.float32), float(attn)
