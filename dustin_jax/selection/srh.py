"""Semantic retrieval head (SRH) configurations: the output of the offline
search (Algorithm 1 of the paper, `profiling.search`) and the default used
until it has run.

An SRH file is JSON:

    {"target": "qwen2.5-7b-instruct", "draft": "qwen2.5-0.5b-instruct",
     "draft_heads": [[layer, head], ...],    # draft (layer, query head) pairs
     "target_heads": [[layer, head], ...],   # target (layer, query head) pairs
     "m": 128, "n_sink": 16, "n_window": 64, "budget": 512,
     "arr": 0.93,                            # ARR reached on calibration data (or null)
     ...}                                    # anything else is kept in `extra`

`target`/`draft` name the model pair the heads were profiled for (free-form
strings; nothing checks them against the loaded models, but head indices are
checked against the models' shapes). Optional keys the policies use when
present: "reduce" ("sum" | "max") and "pool" (odd int).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from dustin_jax.config import ConfigError, ModelConfig
from dustin_jax.selection.select import check_budget

Heads = tuple[tuple[int, int], ...]
REQUIRED = ("target", "draft", "draft_heads", "target_heads", "m", "n_sink", "n_window", "budget")


def normalize_heads(heads, who: str) -> Heads:
  """Sorted, duplicate-free tuple of (layer, head) int pairs, or ConfigError."""
  if heads is None:
    return ()
  if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
    raise ConfigError(f"{who}: expected a list of [layer, head] pairs, got {heads!r}")
  out = []
  for pair in heads:
    if (isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)):
      raise ConfigError(f"{who}: {pair!r} is not a [layer, head] pair of non-negative ints")
    out.append((int(pair[0]), int(pair[1])))
  if len(set(out)) != len(out):
    dup = sorted({p for p in out if out.count(p) > 1})
    raise ConfigError(f"{who}: duplicate (layer, head) pairs {dup}")
  return tuple(sorted(out))


def check_heads(heads: Heads, cfg: ModelConfig, who: str) -> None:
  """ConfigError if a (layer, head) pair does not exist in the model."""
  for layer, head in heads:
    if layer >= cfg.num_layers or head >= cfg.num_heads:
      raise ConfigError(f"{who}: (layer {layer}, head {head}) is out of range for a model "
                        f"with {cfg.num_layers} layers x {cfg.num_heads} query heads")


@dataclasses.dataclass(frozen=True)
class SRHConfig:
  target: str
  draft: str
  draft_heads: Heads
  target_heads: Heads
  m: int
  n_sink: int
  n_window: int
  budget: int
  arr: float | None = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

  def __post_init__(self):
    who = "SRH config"
    for f in ("target", "draft"):
      if not isinstance(getattr(self, f), str):
        raise ConfigError(f"{who}: {f} must be a string naming the model, got "
                          f"{getattr(self, f)!r}")
    object.__setattr__(self, "draft_heads", normalize_heads(self.draft_heads, f"{who} draft_heads"))
    object.__setattr__(self, "target_heads",
                       normalize_heads(self.target_heads, f"{who} target_heads"))
    check_budget(self.budget, self.n_sink, self.n_window, self.m, who=who)
    if self.arr is not None and not (isinstance(self.arr, (int, float)) and 0 <= self.arr <= 1):
      raise ConfigError(f"{who}: arr must be a number in [0, 1] or null, got {self.arr!r}")
    if self.m > 0 and not self.draft_heads:
      raise ConfigError(f"{who}: m={self.m} > 0 needs draft_heads")
    if self.m < self.budget - self.n_sink - self.n_window and not self.target_heads:
      raise ConfigError(f"{who}: m < budget - n_sink - n_window needs target_heads")

  def check_models(self, target_cfg: ModelConfig | None, draft_cfg: ModelConfig | None):
    if target_cfg is not None:
      check_heads(self.target_heads, target_cfg, f"SRH target_heads (target {self.target!r})")
    if draft_cfg is not None:
      check_heads(self.draft_heads, draft_cfg, f"SRH draft_heads (draft {self.draft!r})")
    return self

  def to_json(self) -> dict:
    d = {f: getattr(self, f) for f in REQUIRED}
    d["draft_heads"] = [list(p) for p in self.draft_heads]
    d["target_heads"] = [list(p) for p in self.target_heads]
    d["arr"] = self.arr
    return {**dict(self.extra), **d}


def parse_srh(obj: Mapping[str, Any], source: str = "SRH config") -> SRHConfig:
  if not isinstance(obj, Mapping):
    raise ConfigError(f"{source}: expected a JSON object, got {type(obj).__name__}")
  missing = [k for k in REQUIRED if k not in obj]
  if missing:
    raise ConfigError(f"{source}: missing key(s) {missing}; an SRH file needs {list(REQUIRED)}")
  extra = {k: v for k, v in obj.items() if k not in REQUIRED and k != "arr"}
  try:
    return SRHConfig(**{k: obj[k] for k in REQUIRED}, arr=obj.get("arr"), extra=extra)
  except ConfigError as e:
    raise ConfigError(f"{source}: {e}") from None


def load_srh(path: str, target_cfg: ModelConfig | None = None,
             draft_cfg: ModelConfig | None = None) -> SRHConfig:
  """Read and validate an SRH file; with model configs, check head ranges."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ConfigError(f"SRH file {path!r} does not exist")
  with open(path) as f:
    try:
      obj = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f"SRH file {path!r} is not valid JSON: {e}") from None
  srh = parse_srh(obj, f"SRH file {path!r}")
  try:
    return srh.check_models(target_cfg, draft_cfg)
  except ConfigError as e:
    raise ConfigError(f"SRH file {path!r}: {e}") from None


def save_srh(srh: SRHConfig, path: str) -> None:
  with open(path, "w") as f:
    json.dump(srh.to_json(), f, indent=1)
    f.write("\n")


def default_layers(num_layers: int) -> tuple[int, ...]:
  """Two middle/late layers: at 1/2 and 3/4 of the depth."""
  return tuple(sorted({min(num_layers - 1, num_layers // 2),
                       min(num_layers - 1, (3 * num_layers) // 4)}))


def default_heads(cfg: ModelConfig) -> Heads:
  """2 query heads (0 and num_heads // 2: on different KV heads when the
  model has more than one) in each of `default_layers`."""
  heads = sorted({0, cfg.num_heads // 2})
  return tuple((layer, h) for layer in default_layers(cfg.num_layers) for h in heads)


def default_srh(target_cfg: ModelConfig, draft_cfg: ModelConfig | None, *, budget: int = 512,
                n_sink: int = 16, n_window: int = 64, m: int | None = None,
                target: str = "", draft: str = "") -> SRHConfig:
  """The SRH configuration used until offline profiling has produced one.

  Not profiled, so not tuned: 2 heads in each of 2 middle/late layers of each
  model (`default_heads`), where retrieval heads are usually found, and
  m = half of the free budget (an even draft/target split). Any SRH file
  from `scripts/profile_srh.py` should replace it."""
  free = budget - n_sink - n_window
  if m is None:
    m = free // 2 if draft_cfg is not None else 0
  return SRHConfig(target=target, draft=draft,
                   draft_heads=default_heads(draft_cfg) if draft_cfg is not None else (),
                   target_heads=default_heads(target_cfg), m=m, n_sink=n_sink,
                   n_window=n_window, budget=budget, arr=None,
                   extra={"note": "default heads (not profiled)"})
