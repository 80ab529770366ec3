"""The greedy SRH search of Algorithm 1 of the paper over collected
calibration data (`profiling.collect`), scored by ARR as this project
defines it (`selection.arr`).

Scoring a candidate configuration (draft heads, target heads, m) on every
recorded verify step uses the project's own pieces: the Dustin policy's
`select` (sink + window, top-m by the draft signal, the rest by the target
signal, restricted to committed rows) and `selection.arr.arr_of_indices`
(ARR of that set under the step's full-attention weights). The signals of a
head set are the sums of its heads' recorded scores (the policies' "sum"
reduce); the target signal of step t is the one recorded at step t-1 (zero on
the first step of an item), as in deployment.

Search:
1. every head gets a retrieval score: its ARR when it alone fills the free
   budget (draft heads with m = free, target heads with m = 0);
2. candidates are draft layers (lookahead signal) and target layers
   (historical signal), each represented by its `heads_per_layer` best heads;
3. start empty; repeatedly add the candidate whose inclusion raises ARR most,
   with m re-optimised over a grid at every step (only the m that the sets
   can fill: no draft heads -> m = 0, no target heads -> m = free); stop at
   the head budget or when the gain is below eps;
4. the final m is refined on a finer grid; ARR vs m is kept for the plot.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dustin_jax.selection.arr import arr_of_indices
from dustin_jax.selection.policies import Dustin


@dataclasses.dataclass(frozen=True)
class _Lengths:
  """What `Dustin.select` reads of a cache: lengths and max_len."""
  lengths: jax.Array
  max_len: int


@functools.partial(jax.jit, static_argnames=("budget", "n_sink", "n_window", "m", "pool"))
def arr_of_config(draft_sig, target_sig, lengths, w, *, budget: int, n_sink: int,
                  n_window: int, m: int, pool: int = 1):
  """f32[N]: per recorded step, the ARR of the Dustin selection with these
  signals and m (the heads only matter through the signals)."""
  placeholder = ((0, 0),)
  policy = Dustin(budget=budget, n_sink=n_sink, n_window=n_window, m=m,
                  draft_heads=placeholder, target_heads=placeholder, pool=pool)
  idx = policy.select({"draft": draft_sig, "target": target_sig},
                      _Lengths(lengths, draft_sig.shape[1]), 0)
  arr, _ = arr_of_indices(w[:, None, :], idx, lengths)
  return arr


@dataclasses.dataclass
class CalibData:
  """All recorded steps of all items, with per-head signals kept sparse."""
  lengths: np.ndarray        # int32[N]
  w: np.ndarray              # f32[N, S]
  d_idx: np.ndarray          # [N, Hd, n]   draft head h at step t
  d_val: np.ndarray          # f16[N, Hd, n]
  t_idx: np.ndarray          # [N, Ht, n]   target head h as seen at step t (recorded at t-1)
  t_val: np.ndarray
  draft_shape: tuple         # (layers, heads)
  target_shape: tuple
  items: list                # per item: dict(path, n_steps, tau)

  @property
  def n_steps(self) -> int:
    return len(self.lengths)

  @property
  def max_len(self) -> int:
    return self.w.shape[1]

  def dense(self, kind: str, heads: Sequence[int]) -> np.ndarray:
    """f32[N, S]: the summed signal of flat head indices `heads`."""
    idx, val = (self.d_idx, self.d_val) if kind == "draft" else (self.t_idx, self.t_val)
    out = np.zeros((self.n_steps, self.max_len), np.float32)
    rows = np.arange(self.n_steps)[:, None]
    for h in heads:
      np.add.at(out, (rows, idx[:, h].astype(np.int64)), val[:, h].astype(np.float32))
    return out


def load_calib(paths: Sequence[str]) -> CalibData:
  parts = [dict(np.load(p)) for p in paths]
  if not parts:
    raise ValueError("no calibration data")
  s = {int(p["max_len"]) for p in parts}
  if len(s) != 1:
    raise ValueError(f"calibration items of different max_len {sorted(s)}")
  ld, lt = [], []
  for p in parts:
    # the target-historical signal of step t is step t-1's verify scores
    shifted_i = np.concatenate([np.zeros_like(p["t_idx"][:1]), p["t_idx"][:-1]])
    shifted_v = np.concatenate([np.zeros_like(p["t_val"][:1]), p["t_val"][:-1]])
    ld.append((p["d_idx"], p["d_val"]))
    lt.append((shifted_i, shifted_v))
  cat = lambda xs: np.concatenate(xs, axis=0)
  return CalibData(
      lengths=cat([p["lengths"] for p in parts]).astype(np.int32),
      w=cat([p["w"] for p in parts]).astype(np.float32),
      d_idx=cat([a for a, _ in ld]), d_val=cat([b for _, b in ld]),
      t_idx=cat([a for a, _ in lt]), t_val=cat([b for _, b in lt]),
      draft_shape=tuple(int(x) for x in parts[0]["draft_shape"]),
      target_shape=tuple(int(x) for x in parts[0]["target_shape"]),
      items=[dict(path=str(pth), n_steps=int(len(p["lengths"])), tau=float(p["tau"]),
                  seconds=float(p["prefill_s"]) + float(p["decode_s"]))
             for pth, p in zip(paths, parts)])


@dataclasses.dataclass
class SearchResult:
  draft_heads: list          # [[layer, head], ...]
  target_heads: list
  m: int
  arr: float
  history: list              # per greedy step: dict(n_heads, arr, m, added)
  m_curve: list              # [(m, arr)] for the final heads
  head_scores: dict          # {"draft": [[layer, head, score], ...], "target": ...} best first
  baselines: dict            # ARR of the sink+window-only fallbacks etc.
  seconds: float
  n_window: int = 0          # the local window chosen (the given one unless a grid was searched)
  window_curve: list = dataclasses.field(default_factory=list)   # [(n_window, m, arr)]


class Evaluator:
  """Mean ARR over the recorded steps of (draft signal, target signal, m)."""

  def __init__(self, data: CalibData, budget: int, n_sink: int, n_window: int, pool: int = 1):
    self.data = data
    self.budget, self.n_sink, self.n_window, self.pool = budget, n_sink, n_window, pool
    self.free = budget - n_sink - n_window
    self.lengths = jnp.asarray(data.lengths)
    self.w = jnp.asarray(data.w)
    self.zeros = jnp.zeros_like(self.w)
    self.calls = 0

  def __call__(self, dsig, tsig, m: int) -> float:
    self.calls += 1
    arr = arr_of_config(self.zeros if dsig is None else dsig,
                        self.zeros if tsig is None else tsig, self.lengths, self.w,
                        budget=self.budget, n_sink=self.n_sink, n_window=self.n_window,
                        m=int(m), pool=self.pool)
    return float(jnp.mean(arr))

  def feasible(self, grid: Sequence[int], has_draft: bool, has_target: bool) -> list[int]:
    if not has_draft and not has_target:
      return [0]
    if not has_draft:
      return [0]
    if not has_target:
      return [self.free]
    return sorted({int(m) for m in grid if 0 <= m <= self.free})

  def best_m(self, dsig, tsig, grid, has_draft, has_target) -> tuple[float, int, list]:
    curve = [(m, self(dsig, tsig, m)) for m in self.feasible(grid, has_draft, has_target)]
    m, a = max(curve, key=lambda x: (x[1], -x[0]))
    return a, m, curve


def m_grid(free: int, points: int) -> list[int]:
  return sorted({int(round(free * i / (points - 1))) for i in range(points)})


def greedy_search(data: CalibData, *, budget: int = 512, n_sink: int = 16, n_window: int = 64,
                  head_budget: int = 8, heads_per_layer: int = 2, eps: float = 1e-3,
                  grid_points: int = 9, fine_points: int = 33, pool: int = 1,
                  windows: Sequence[int] = (), progress: bool = False) -> SearchResult:
  """`windows`: optional other local-window sizes tried for the final heads
  (m re-optimised for each); the best ARR wins."""
  from tqdm.auto import tqdm
  t0 = time.perf_counter()
  ev = Evaluator(data, budget, n_sink, n_window, pool)
  free = ev.free
  dl, dh = data.draft_shape
  tl, th = data.target_shape
  baselines = {"sink_window_only": ev(None, None, 0),
               # StreamingLLM at this budget: sink + the most recent rows
               "streaming": Evaluator(data, budget, n_sink, budget - n_sink, pool)(None, None, 0),
               # the Oracle: the top-budget rows of the true attention (no sink/window)
               "oracle": Evaluator(data, budget, 0, 0, 1)(jnp.asarray(data.w), None, budget)}

  # 1. retrieval score of every head alone
  scores = {"draft": np.zeros((dl, dh)), "target": np.zeros((tl, th))}
  jobs = [("draft", l, h) for l in range(dl) for h in range(dh)] + \
         [("target", l, h) for l in range(tl) for h in range(th)]
  for kind, l, h in tqdm(jobs, desc="head scores", disable=not progress, leave=False):
    nh = dh if kind == "draft" else th
    sig = jnp.asarray(data.dense(kind, [l * nh + h]))
    scores[kind][l, h] = (ev(sig, None, free) if kind == "draft" else ev(None, sig, 0))
  head_scores = {k: sorted(([int(l), int(h), float(v[l, h])] for l in range(v.shape[0])
                            for h in range(v.shape[1])), key=lambda x: -x[2])
                 for k, v in scores.items()}

  # 2. candidates: layers with their best heads
  cands = []
  for kind, (nl, nh) in (("draft", (dl, dh)), ("target", (tl, th))):
    for l in range(nl):
      best = np.argsort(-scores[kind][l], kind="stable")[:heads_per_layer]
      heads = [(l, int(h)) for h in sorted(best)]
      sig = data.dense(kind, [l * nh + h for _, h in heads])
      cands.append(dict(kind=kind, layer=l, heads=heads, sig=sig))

  # 3. greedy
  chosen = {"draft": [], "target": []}
  sums = {"draft": None, "target": None}
  grid = m_grid(free, grid_points)
  cur_arr, cur_m = baselines["sink_window_only"], 0
  history = [dict(n_heads=0, arr=cur_arr, m=0, added=None)]
  used = set()
  bar = tqdm(total=head_budget, desc="greedy", disable=not progress, leave=False)
  while True:
    n_now = len(chosen["draft"]) + len(chosen["target"])
    best = None
    for ci, c in enumerate(cands):
      if ci in used or n_now + len(c["heads"]) > head_budget:
        continue
      trial = dict(sums)
      trial[c["kind"]] = c["sig"] if sums[c["kind"]] is None else sums[c["kind"]] + c["sig"]
      a, m, _ = ev.best_m(None if trial["draft"] is None else jnp.asarray(trial["draft"]),
                          None if trial["target"] is None else jnp.asarray(trial["target"]),
                          grid, trial["draft"] is not None, trial["target"] is not None)
      if best is None or a > best[0]:
        best = (a, m, ci, trial)
    if best is None or best[0] - cur_arr < eps:
      break
    a, m, ci, trial = best
    used.add(ci)
    c = cands[ci]
    chosen[c["kind"]].extend(c["heads"])
    sums = trial
    cur_arr, cur_m = a, m
    history.append(dict(n_heads=n_now + len(c["heads"]), arr=a, m=m,
                        added=dict(kind=c["kind"], layer=c["layer"],
                                   heads=[list(x) for x in c["heads"]])))
    bar.update(len(c["heads"]))
  bar.close()

  # 4. refine m on a finer grid; ARR vs m of the final heads (and each signal alone)
  ds = None if sums["draft"] is None else jnp.asarray(sums["draft"])
  ts = None if sums["target"] is None else jnp.asarray(sums["target"])
  fine = m_grid(free, fine_points)
  a, m, curve = ev.best_m(ds, ts, fine, ds is not None, ts is not None)
  if a >= cur_arr:
    cur_arr, cur_m = a, m
  if ds is not None:
    baselines["final_draft_heads_only"] = ev(ds, None, free)
  if ts is not None:
    baselines["final_target_heads_only"] = ev(None, ts, 0)
  best_window, window_curve = n_window, [(n_window, int(cur_m), float(cur_arr))]
  for win in sorted(set(int(x) for x in windows) - {n_window}):
    if budget - n_sink - win < 0:
      continue
    ev_w = Evaluator(data, budget, n_sink, win, pool)
    a_w, m_w, c_w = ev_w.best_m(ds, ts, m_grid(ev_w.free, fine_points), ds is not None,
                                ts is not None)
    window_curve.append((win, int(m_w), float(a_w)))
    if a_w > cur_arr:
      cur_arr, cur_m, best_window, curve = a_w, m_w, win, c_w
  return SearchResult(
      draft_heads=[list(x) for x in sorted(chosen["draft"])],
      target_heads=[list(x) for x in sorted(chosen["target"])],
      m=int(cur_m), arr=float(cur_arr), history=history,
      m_curve=[(int(x), float(y)) for x, y in curve], head_scores=head_scores,
      baselines=baselines, seconds=time.perf_counter() - t0, n_window=best_window,
      window_curve=sorted(window_curve))


def plot_profile(res: SearchResult, path: str, title: str = "") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
  xs = [h["n_heads"] for h in res.history]
  ys = [h["arr"] for h in res.history]
  ax[0].plot(xs, ys, "o-")
  for h in res.history[1:]:
    a = h["added"]
    ax[0].annotate(f"{a['kind'][0]}L{a['layer']}", (h["n_heads"], h["arr"]), fontsize=7,
                   textcoords="offset points", xytext=(2, -10))
  ax[0].set_xlabel("number of SRHs (draft + target)")
  ax[0].set_ylabel("ARR (calibration)")
  ax[0].set_title("greedy search")
  ax[0].grid(alpha=0.3)
  if res.m_curve:
    ax[1].plot([m for m, _ in res.m_curve], [a for _, a in res.m_curve], "o-", ms=3)
    ax[1].axvline(res.m, color="gray", ls="--", lw=1)
  ax[1].set_xlabel("m (rows chosen by the draft signal)")
  ax[1].set_ylabel("ARR")
  ax[1].set_title("ARR vs m (final heads)")
  ax[1].grid(alpha=0.3)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
