"""Selection policies: frozen (hashable, jit-static) dataclasses implementing
the seam of `selection/base.py`.

| name          | class          | I_verify                                                 |
|---------------|----------------|----------------------------------------------------------|
| full          | FullCache      | None: the whole cache (lossless SD)                      |
| dustin        | Dustin         | sink + window, top-m by draft SRHs, rest by target SRHs  |
| dustin_target | DustinTarget   | sink + window, rest by target SRHs (m = 0)               |
| dustin_draft  | DustinDraft    | sink + window, rest by draft SRHs                        |
| streaming     | Streaming      | sink + the most recent budget - n_sink rows              |
| quest         | Quest          | sink + window, rest by Quest page bounds                 |
| oracle        | Oracle         | top-K by the target's true attention (evaluation only)   |

Signals (carried from step to step in `SpecState.signals`):

* draft-lookahead, `signals["draft"]: f32[B, S]`: replaced each step by the
  scores of the step's gamma draft queries (those predicting d_1 .. d_gamma),
  summed (or maxed) over them; query t at position `draft_cache.lengths[b] + t`
  scores the draft keys `p <= lengths[b] + t`.
* target-historical, `signals["target"]: f32[B, S]`: computed in
  `observe_target` from the gamma+1 verify queries against the FULL target
  cache (keys `p <= lengths[b] + t`: the committed context and, causally, the
  block), whatever set the verify itself attended to; it replaces the old
  signal and is what the NEXT step's `select` reads. Staleness: every row
  committed at the last commit was a key of that verify (the accepted block
  rows carry the right tokens), so every committed row has a score one step
  old -- the rows of the last block only from the queries after them, so
  they score low, but the window covers them when n_window >= gamma + 1.
  Rows never scored read 0: all of them on the first step after prefill
  (the prefill does not call the policy), when the target tier falls back to
  the lowest positions (ties break towards lower positions).

Every policy reads only its configured layers: the models return taps of
`draft_tap_layers` / `target_tap_layers` only, and the signals call
`srh_scores` once per configured layer on the configured heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from dustin_jax.config import ConfigError, ModelConfig
from dustin_jax.selection import signals as sig
from dustin_jax.selection.base import FullCache, PolicyDefaults, sink_window_indices
from dustin_jax.selection.select import (check_budget, committed_mask, sort_and_pad,
                                         tiered_select, top_tier)
from dustin_jax.selection.srh import Heads, check_heads, default_heads, load_srh, normalize_heads

REDUCES = ("sum", "max")


def _check_common(p, who: str):
  if p.reduce not in REDUCES:
    raise ConfigError(f"{who}: reduce must be one of {REDUCES}, got {p.reduce!r}")
  if not isinstance(p.pool, int) or p.pool < 1 or p.pool % 2 == 0:
    raise ConfigError(f"{who}: pool must be an odd int >= 1 (1 = no pooling), got {p.pool!r}")


class _TieredSRH(PolicyDefaults):
  """Shared body of Dustin, DustinTarget and DustinDraft. Subclasses define
  budget, n_sink, n_window, draft_heads, target_heads, reduce, pool, impl and
  `draft_tier` (how many rows the draft signal picks after sink + window)."""

  @property
  def draft_tap_layers(self) -> tuple[int, ...]:
    return tuple(sorted({layer for layer, _ in self.draft_heads}))

  @property
  def target_tap_layers(self) -> tuple[int, ...]:
    return tuple(sorted({layer for layer, _ in self.target_heads}))

  def _validate(self):
    who = f"policy {self.name!r}"
    for f in ("draft_heads", "target_heads"):
      if f in {x.name for x in dataclasses.fields(self)}:
        object.__setattr__(self, f, normalize_heads(getattr(self, f), f"{who}: {f}"))
    check_budget(self.budget, self.n_sink, self.n_window, self.draft_tier, who=who)
    _check_common(self, who)
    free = self.budget - self.n_sink - self.n_window
    if self.draft_tier > 0 and not self.draft_heads:
      raise ConfigError(f"{who}: the draft tier ({self.draft_tier} rows) needs draft_heads")
    if self.draft_tier < free and not self.target_heads:
      raise ConfigError(f"{who}: the target tier ({free - self.draft_tier} rows) needs "
                        "target_heads")

  def init(self, batch: int, max_len: int):
    zeros = lambda: jnp.zeros((batch, max_len), jnp.float32)
    out = {}
    if self.draft_heads:
      out["draft"] = zeros()
    if self.target_heads:
      out["target"] = zeros()
    return out

  def observe_draft(self, signals, taps, draft_cache):
    if not self.draft_heads:
      return signals
    new = sig.srh_signal(self.draft_heads, taps, draft_cache, reduce=self.reduce, impl=self.impl)
    return {**signals, "draft": new}

  def select(self, signals, target_cache, gamma):
    lengths, s = target_cache.lengths, target_cache.max_len
    free = self.budget - self.n_sink - self.n_window
    tiers = []
    for key, k in (("draft", self.draft_tier), ("target", free - self.draft_tier)):
      if k > 0:
        if signals[key].shape[1] != s:
          raise ValueError(f"the {key} signal covers {signals[key].shape[1]} rows but the "
                           f"target cache has {s}: init the policy with the cache's max_len")
        tiers.append((sig.restrict_and_pool(signals[key], lengths, self.pool), k))
    return tiered_select(lengths, s, self.budget, self.n_sink, self.n_window, tiers)

  def observe_target(self, signals, taps, target_cache, gamma):
    if not self.target_heads:
      return signals
    new = sig.srh_signal(self.target_heads, taps, target_cache, reduce=self.reduce,
                         impl=self.impl)
    return {**signals, "target": new}


@dataclasses.dataclass(frozen=True)
class Dustin(_TieredSRH):
  """Dustin's draft-augmented verification set: sink + window, top-`m` by
  the draft SRHs' lookahead, the rest of `budget` by the target SRHs'
  history."""
  name = "dustin"
  budget: int = 512
  n_sink: int = 16
  n_window: int = 64
  m: int = 128
  draft_heads: Heads = ()      # (layer, query head) pairs of the draft
  target_heads: Heads = ()     # (layer, query head) pairs of the target
  reduce: str = "sum"          # over heads, queries, layers and draft steps
  pool: int = 1                # odd max-pool width over neighbouring rows
  impl: str = "auto"           # srh_scores implementation

  @property
  def draft_tier(self) -> int:
    return self.m

  def __post_init__(self):
    self._validate()


@dataclasses.dataclass(frozen=True)
class DustinTarget(_TieredSRH):
  """Ablation: target-historical signal only (Dustin with m = 0)."""
  name = "dustin_target"
  draft_heads = ()
  draft_tier = 0
  budget: int = 512
  n_sink: int = 16
  n_window: int = 64
  target_heads: Heads = ()
  reduce: str = "sum"
  pool: int = 1
  impl: str = "auto"

  def __post_init__(self):
    self._validate()


@dataclasses.dataclass(frozen=True)
class DustinDraft(_TieredSRH):
  """Ablation: draft-lookahead signal only (it fills the whole free budget)."""
  name = "dustin_draft"
  target_heads = ()
  budget: int = 512
  n_sink: int = 16
  n_window: int = 64
  draft_heads: Heads = ()
  reduce: str = "sum"
  pool: int = 1
  impl: str = "auto"

  @property
  def draft_tier(self) -> int:
    return self.budget - self.n_sink - self.n_window

  def __post_init__(self):
    self._validate()


@dataclasses.dataclass(frozen=True)
class Streaming(PolicyDefaults):
  """StreamingLLM: the first `n_sink` rows and the most recent
  `budget - n_sink`; no signal."""
  name = "streaming"
  draft_tap_layers = ()
  target_tap_layers = ()
  budget: int = 512
  n_sink: int = 16

  def __post_init__(self):
    check_budget(self.budget, 0, 0, who="policy 'streaming'")
    if not isinstance(self.n_sink, int) or not 0 <= self.n_sink <= self.budget:
      raise ConfigError(f"policy 'streaming': n_sink={self.n_sink!r} must lie in [0, budget = "
                        f"{self.budget}] (the window is budget - n_sink)")

  def init(self, batch, max_len):
    return ()

  def observe_draft(self, signals, taps, draft_cache):
    return signals

  def select(self, signals, target_cache, gamma):
    idx = sink_window_indices(target_cache.lengths, self.n_sink, self.budget - self.n_sink)
    return sort_and_pad(idx, self.budget)

  def observe_target(self, signals, taps, target_cache, gamma):
    return signals


@dataclasses.dataclass(frozen=True)
class Quest(PolicyDefaults):
  """Quest (Tang et al. 2024), adapted to one verification set per sequence.

  Page metadata: per `page` rows, layer of `layers` and KV head, the
  elementwise min and max of the keys, kept in the signals pytree
  (`kmin`/`kmax`: per layer [B, Hkv, P, D] in the cache dtype, `upto`:
  int32[B] the rows they cover). `observe_target` brings them up to the
  committed rows `< lengths[b]` (the pre-commit lengths of that step: only
  committed rows, never the block) by recomputing the pages from `upto`
  (a full rebuild on the first step after prefill).

  Queries: Quest bounds q.k with the current query, but `select` runs before
  the verify queries exist. Adaptation: the page scores are computed in
  `observe_target` with THIS verify's queries (the gamma+1 of each layer of
  `layers`, all query heads) and used by the NEXT step's select -- the
  previous verify's queries, as the target-historical signal of Dustin.
  Per (layer, head, query) the upper bounds are softmaxed over the pages
  and summed (or maxed, `reduce`) over heads, queries and layers (one set is
  shared by all of them). The rows committed at the last commit lie in pages
  not yet covered (score 0 or a partial page); the window covers them when
  n_window >= gamma + 1.

  Selection: sink + window, then the remaining rows by their page's score
  (whole pages, ties towards lower rows; the last page may be cut)."""
  name = "quest"
  draft_tap_layers = ()
  budget: int = 512
  n_sink: int = 16
  n_window: int = 64
  layers: tuple[int, ...] = ()   # target layers whose metadata and queries are used
  num_kv_heads: int = 1          # target model shape (metadata buffers are allocated in init)
  head_dim: int = 128
  dtype: str = "bfloat16"        # the target cache dtype
  page: int = 16
  reduce: str = "sum"

  def __post_init__(self):
    who = "policy 'quest'"
    check_budget(self.budget, self.n_sink, self.n_window, who=who)
    layers = tuple(sorted(set(int(x) for x in self.layers)))
    if not layers or min(layers) < 0:
      raise ConfigError(f"{who}: layers must be a non-empty list of target layer indices, "
                        f"got {self.layers!r}")
    object.__setattr__(self, "layers", layers)
    if self.page < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
      raise ConfigError(f"{who}: page, num_kv_heads and head_dim must be >= 1")
    if self.reduce not in REDUCES:
      raise ConfigError(f"{who}: reduce must be one of {REDUCES}, got {self.reduce!r}")

  @property
  def target_tap_layers(self) -> tuple[int, ...]:
    return self.layers

  def init(self, batch, max_len):
    metas = [sig.init_pages(batch, self.num_kv_heads, max_len, self.head_dim, self.page,
                            jnp.dtype(self.dtype)) for _ in self.layers]
    n_pages = metas[0][0].shape[2]
    return {"kmin": tuple(m[0] for m in metas), "kmax": tuple(m[1] for m in metas),
            "upto": jnp.zeros((batch,), jnp.int32),
            "score": jnp.zeros((batch, n_pages), jnp.float32)}

  def observe_draft(self, signals, taps, draft_cache):
    return signals

  def observe_target(self, signals, taps, target_cache, gamma):
    hi = target_cache.lengths
    n_upd = -(-gamma // self.page) + 1   # pages a step's gamma + 1 commits can touch
    kmins, kmaxs, score = [], [], None
    for j, layer in enumerate(self.layers):
      mn, mx = sig.update_pages(signals["kmin"][j], signals["kmax"][j], target_cache.k[layer],
                                signals["upto"], hi, self.page, n_upd)
      kmins.append(mn)
      kmaxs.append(mx)
      s = sig.page_scores(taps[layer], mn, mx, hi, self.page, reduce=self.reduce)
      score = s if score is None else sig.combine(score, s, self.reduce)
    return {"kmin": tuple(kmins), "kmax": tuple(kmaxs), "upto": hi.astype(jnp.int32),
            "score": score}

  def select(self, signals, target_cache, gamma):
    s = target_cache.max_len
    rows = jnp.arange(s, dtype=jnp.int32) // self.page
    tok = signals["score"][:, rows]
    tok = sig.restrict_and_pool(tok, target_cache.lengths, 1)
    free = self.budget - self.n_sink - self.n_window
    return tiered_select(target_cache.lengths, s, self.budget, self.n_sink, self.n_window,
                         [(tok, free)] if free else [])


@dataclasses.dataclass(frozen=True)
class Oracle(PolicyDefaults):
  """Upper bound for evaluation: the K committed rows with the largest
  attention mass of the target's FULL attention at this step's verify
  queries (mean over every layer, query head and verify query of the
  probabilities renormalised over the context -- exactly what ARR counts,
  so no K-row set has a higher ARR). No sink/window is forced.

  The queries do not exist before verify: `needs_full_verify` makes the step
  run the target over the block with the full cache first and call
  `observe_full_verify(signals, taps_of_all_layers, cache_with_block, gamma)`
  before `select` (a second target pass per step: evaluation only)."""
  name = "oracle"
  draft_tap_layers = ()
  target_tap_layers = ()
  budget: int = 512
  num_layers: int = 1            # target layers (all are tapped by the full pass)
  impl: str = "auto"

  def __post_init__(self):
    if not isinstance(self.budget, int) or self.budget < 1:
      raise ConfigError(f"policy 'oracle': budget must be an int >= 1, got {self.budget!r}")
    if self.num_layers < 1:
      raise ConfigError(f"policy 'oracle': num_layers must be >= 1, got {self.num_layers}")

  @property
  def full_verify_tap_layers(self) -> tuple[int, ...]:
    return tuple(range(self.num_layers))

  def init(self, batch, max_len):
    return {}

  def observe_draft(self, signals, taps, draft_cache):
    return signals

  def observe_full_verify(self, signals, taps, target_cache, gamma):
    w = None
    for layer in self.full_verify_tap_layers:
      x = sig.attention_weights(taps[layer], target_cache.k[layer], target_cache.lengths,
                                impl=self.impl)
      w = x if w is None else w + x
    return {**signals, "w": w}

  def select(self, signals, target_cache, gamma):
    if "w" not in signals:
      raise ValueError("the oracle ranks rows by this step's own verify queries: its signal "
                       "comes from observe_full_verify, after a full-cache target pass")
    lengths, s = target_cache.lengths, target_cache.max_len
    idx, _ = top_tier(signals["w"], committed_mask(lengths, s), self.budget)
    return sort_and_pad(idx, self.budget)

  def observe_target(self, signals, taps, target_cache, gamma):
    return {k: v for k, v in signals.items() if k != "w"}


POLICIES = {"full": FullCache, "dustin": Dustin, "dustin_target": DustinTarget,
            "dustin_draft": DustinDraft, "streaming": Streaming, "quest": Quest,
            "oracle": Oracle}


def field_names(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def make_policy(name: str, *, target_cfg: ModelConfig | None = None,
                draft_cfg: ModelConfig | None = None, **fields):
  """A policy by name, e.g. `make_policy("dustin", budget=512, m=128,
  draft_heads=[[8, 0]], target_heads=[[20, 3]], target_cfg=t, draft_cfg=d)`.

  With model configs, head indices are checked against the models and the
  shape fields of `quest` (layers = all target layers unless given,
  num_kv_heads, head_dim, dtype) and `oracle` (num_layers) are filled in.
  Every problem is one ConfigError."""
  if name not in POLICIES:
    raise ConfigError(f"unknown policy {name!r}; choose one of {tuple(POLICIES)}")
  cls = POLICIES[name]
  if name == "quest":
    if target_cfg is None and not {"num_kv_heads", "head_dim", "layers"} <= fields.keys():
      raise ConfigError("policy 'quest' needs target_cfg (or layers, num_kv_heads, head_dim)")
    if target_cfg is not None:
      fields.setdefault("layers", tuple(range(target_cfg.num_layers)))
      fields.setdefault("num_kv_heads", target_cfg.num_kv_heads)
      fields.setdefault("head_dim", target_cfg.head_dim)
      fields.setdefault("dtype", target_cfg.dtype)
  if name == "oracle" and target_cfg is not None:
    fields.setdefault("num_layers", target_cfg.num_layers)
  unknown = sorted(set(fields) - set(field_names(cls)))
  if unknown:
    raise ConfigError(f"policy {name!r} has no field(s) {unknown}; its fields: "
                      f"{list(field_names(cls))}")
  policy = cls(**fields)
  who = f"policy {name!r}"
  if target_cfg is not None:
    check_heads(getattr(policy, "target_heads", ()), target_cfg, f"{who}: target_heads")
    if name == "quest" and max(policy.layers) >= target_cfg.num_layers:
      raise ConfigError(f"{who}: layers {policy.layers} out of range for a target with "
                        f"{target_cfg.num_layers} layers")
    if name == "oracle" and policy.num_layers != target_cfg.num_layers:
      raise ConfigError(f"{who}: num_layers={policy.num_layers} but the target has "
                        f"{target_cfg.num_layers}")
  if draft_cfg is not None:
    check_heads(getattr(policy, "draft_heads", ()), draft_cfg, f"{who}: draft_heads")
  return policy


def _get(cfg, key, default=None):
  if isinstance(cfg, Mapping):
    v = cfg.get(key, None)
  else:
    v = getattr(cfg, key, None)
  return default if v is None or v == "" else v


def policy_from_config(dustin_cfg, target_cfg: ModelConfig, draft_cfg: ModelConfig | None):
  """The policy of a run config's `dustin` section (a ConfigDict or a dict).

  Fields read: policy, budget, n_sink, n_window, m, srh_file and optionally
  reduce, pool, quest_layers, page, impl. Heads come from `srh_file` (the
  offline search's JSON) or, when it is empty, from the documented default
  (`srh.default_heads`: 2 heads in each of 2 middle/late layers, m = half of
  the free budget). A field that is None (or absent) takes the SRH file's
  value; a set one wins over the file. Fields a policy does not have (m for
  dustin_target, heads for streaming, ...) are dropped."""
  name = _get(dustin_cfg, "policy", "full")
  if name not in POLICIES:
    raise ConfigError(f"unknown policy {name!r}; choose one of {tuple(POLICIES)}")
  if name == "full":
    return FullCache()
  if name in ("dustin", "dustin_draft") and draft_cfg is None:
    raise ConfigError(f"policy {name!r} reads the draft's attention: it needs a draft model")
  path = _get(dustin_cfg, "srh_file")
  srh = load_srh(path, target_cfg, draft_cfg) if path else None

  def pick(key, default):
    return _get(dustin_cfg, key, getattr(srh, key) if srh is not None else default)

  budget, n_sink, n_window = pick("budget", 512), pick("n_sink", 16), pick("n_window", 64)
  check_budget(budget, n_sink, n_window, who=f"dustin config (policy {name!r})")
  extra = srh.extra if srh is not None else {}
  fields: dict[str, Any] = dict(
      budget=budget, n_sink=n_sink, n_window=n_window,
      m=pick("m", (budget - n_sink - n_window) // 2),
      draft_heads=(srh.draft_heads if srh is not None else
                   default_heads(draft_cfg) if draft_cfg is not None else ()),
      target_heads=srh.target_heads if srh is not None else default_heads(target_cfg),
      reduce=_get(dustin_cfg, "reduce", extra.get("reduce", "sum")),
      pool=_get(dustin_cfg, "pool", extra.get("pool", 1)),
      impl=_get(dustin_cfg, "impl", "auto"),
      page=_get(dustin_cfg, "page", 16))
  layers = _get(dustin_cfg, "quest_layers")
  if layers is not None:
    fields["layers"] = tuple(layers)
  allowed = set(field_names(POLICIES[name]))
  return make_policy(name, target_cfg=target_cfg, draft_cfg=draft_cfg,
                     **{k: v for k, v in fields.items() if k in allowed})
