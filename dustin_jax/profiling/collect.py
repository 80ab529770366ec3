"""Calibration data for the offline SRH search (Algorithm 1 of the paper).

What the search needs to score ANY candidate head set offline, recorded per
verify step of REAL speculative decoding on calibration text:

* `w`: the target's full attention at the step's verify queries, as ARR
  counts it (`selection.arr.layer_weights`, averaged over the layers: ARR is
  linear in the set, so ARR(I) = sum of `w` over I);
* `draft`: the draft-lookahead score of EVERY draft (layer, query head): the
  SRH score (`kernels.srh_scores`) of that single head, summed over the gamma
  draft queries of the step -- what `Dustin.observe_draft` computes;
* `target`: the score of EVERY target (layer, query head) at the step's
  gamma+1 verify queries against the full cache -- what
  `Dustin.observe_target` computes; the search uses step t-1's scores for
  step t (the target-historical signal), zero on the first step;
* `lengths`: the committed length at selection time.

The trajectory is the lossless one: the step with `StepOptions(verify="full")`
with the `Recorder` policy below (it taps every layer of both models, never
restricts the verification), greedy, so every candidate set is scored on the
same states.

Storage: per step and head only the top-`top_n` rows (indices uint16/int32,
values float16); `w` as float16 (dense). One npz per calibration item in
the cache directory, named by a hash of everything that determines it, so a
rerun skips items already collected and an interrupted profile resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dustin_jax.profiling.runtime import prefill_base, run_policy
from dustin_jax.selection.arr import layer_weights
from dustin_jax.selection.base import PolicyDefaults
from kernels.srh_scores.ops import srh_scores

FORMAT_VERSION = 1


def per_head_scores(q: jax.Array, k: jax.Array, lengths: jax.Array, *,
                    impl: str = "auto") -> jax.Array:
  """f32[B, Hq, S]: the SRH score of every query head of one layer on its
  own (`srh_scores` of that one head, summed over the T queries).
  q: [B, T, Hq, D], query t at `lengths[b] + t`; k: [B, Hkv, S, D]."""
  hq, hkv = q.shape[2], k.shape[1]
  group = hq // hkv
  out = []
  for g in range(hkv):
    def one(qh, g=g):  # qh: [B, T, D] one query head
      return srh_scores(qh[:, :, None, :], k, lengths, (g,), reduce="sum", impl=impl)
    qg = q[:, :, g * group:(g + 1) * group]               # [B, T, G, D]
    out.append(jax.vmap(one, in_axes=2, out_axes=1)(qg))  # [B, G, S]
  return jnp.concatenate(out, axis=1)


@dataclasses.dataclass(frozen=True)
class Recorder(PolicyDefaults):
  """A policy (the seam of selection/base.py) that verifies with the full
  cache and records every head's signal and the ARR weights.

  signals: "draft" f32[B, Ld*Hd, S] (accumulated over the draft queries of
  the step), "target" f32[B, Lt*Ht, S] (this step's verify), "w" f32[B, S]."""
  name = "recorder"
  draft_layers: int = 1
  draft_heads_per_layer: int = 1
  target_layers: int = 1
  target_heads_per_layer: int = 1
  impl: str = "auto"

  @property
  def draft_tap_layers(self):
    return tuple(range(self.draft_layers))

  @property
  def target_tap_layers(self):
    return tuple(range(self.target_layers))

  @property
  def full_verify_tap_layers(self):
    return tuple(range(self.target_layers))

  def init(self, batch, max_len):
    z = lambda n: jnp.zeros((batch, n, max_len), jnp.float32)
    return {"draft": z(self.draft_layers * self.draft_heads_per_layer),
            "target": z(self.target_layers * self.target_heads_per_layer),
            "w": jnp.zeros((batch, max_len), jnp.float32)}

  def observe_draft(self, signals, taps, draft_cache):
    new = jnp.concatenate([per_head_scores(taps[l], draft_cache.k[l], draft_cache.lengths,
                                           impl=self.impl) for l in self.draft_tap_layers], 1)
    return {**signals, "draft": new}

  def observe_full_verify(self, signals, taps, target_cache, gamma):
    w = jnp.mean(layer_weights(taps, target_cache, impl=self.impl), axis=1)
    return {**signals, "w": w}

  def select(self, signals, target_cache, gamma):
    return None

  def observe_target(self, signals, taps, target_cache, gamma):
    new = jnp.concatenate([per_head_scores(taps[l], target_cache.k[l], target_cache.lengths,
                                           impl=self.impl) for l in self.target_tap_layers], 1)
    return {**signals, "target": new}


def recorder_for(pair) -> Recorder:
  t, d = pair.target.cfg, pair.draft.cfg
  return Recorder(d.num_layers, d.num_heads, t.num_layers, t.num_heads)


def _topn(x: np.ndarray, n: int, idx_dtype):
  """Top-n rows of x[H, S] per head: (idx[H, n], val f16[H, n])."""
  n = min(n, x.shape[1])
  idx = np.argpartition(-x, n - 1, axis=1)[:, :n]
  val = np.take_along_axis(x, idx, axis=1)
  return idx.astype(idx_dtype), val.astype(np.float16)


@dataclasses.dataclass
class CalibItem:
  """One calibration prompt: where it comes from (for the SRH file)."""
  text: str
  offset: int
  tokens: list


def item_key(pair, item: CalibItem, *, gamma: int, max_new: int, max_len: int, top_n: int):
  h = hashlib.sha256(json.dumps(dict(
      v=FORMAT_VERSION, model=pair.model_name, text=item.text, offset=item.offset,
      n=len(item.tokens), tok=hashlib.sha256(np.asarray(item.tokens, np.int64).tobytes())
      .hexdigest(), gamma=gamma, max_new=max_new, max_len=max_len, top_n=top_n),
      sort_keys=True).encode()).hexdigest()[:16]
  return f"calib_{item.text}_{item.offset}_{len(item.tokens)}_{h}.npz"


def collect_item(pair, item: CalibItem, *, gamma: int, max_new: int, max_len: int,
                 top_n: int = 1024, progress: bool = False, kv_cache_dir=None) -> dict:
  """Run lossless greedy SD over one calibration prompt with the Recorder;
  returns the per-step arrays (see the module docstring)."""
  rec = recorder_for(pair)
  base = prefill_base(pair, [item.tokens], max_len, progress=progress, cache_dir=kv_cache_dir)
  idx_dtype = np.uint16 if max_len <= 65535 else np.int32
  steps = dict(lengths=[], w=[], d_idx=[], d_val=[], t_idx=[], t_val=[])
  lengths = [int(len(item.tokens) - 1)]

  def on_step(st, out):
    sig, n, active = jax.device_get((st.signals, out.n_emitted, out.active))
    if not active[0]:
      return
    steps["lengths"].append(lengths[0])
    steps["w"].append(sig["w"][0].astype(np.float16))
    for key, p in (("draft", "d"), ("target", "t")):
      i, v = _topn(sig[key][0], top_n, idx_dtype)
      steps[f"{p}_idx"].append(i)
      steps[f"{p}_val"].append(v)
    lengths[0] += int(n[0])

  t0 = time.perf_counter()
  res = _run_recorded(pair, base, rec, gamma, max_new, on_step, progress)
  out = {k: np.stack(v) for k, v in steps.items()}
  out.update(tau=np.float32(res.stats.tau), max_len=np.int32(max_len),
             prefill_s=np.float32(base.prefill_s),
             decode_s=np.float32(time.perf_counter() - t0),
             draft_shape=np.asarray([pair.draft.cfg.num_layers, pair.draft.cfg.num_heads]),
             target_shape=np.asarray([pair.target.cfg.num_layers, pair.target.cfg.num_heads]))
  return out


def _run_recorded(pair, base, rec, gamma, max_new, on_step, progress):
  """The lossless trajectory (`verify="full"`) with the Recorder."""
  return run_policy(pair, base, rec, gamma=gamma, max_new_tokens=max_new, verify="full",
                    on_step=on_step, progress=progress)


def collect(pair, items: Sequence[CalibItem], cache_dir: str, *, gamma: int, max_new: int,
            max_len: int, top_n: int = 1024, resume: bool = True,
            progress: bool = False, kv_cache_dir=None) -> list[str]:
  """Collect every item into `cache_dir` (skipping those already there when
  `resume`); returns the npz paths in item order."""
  from tqdm.auto import tqdm
  os.makedirs(cache_dir, exist_ok=True)
  paths = []
  for item in tqdm(items, desc="calibration items", disable=not progress):
    path = os.path.join(cache_dir, item_key(pair, item, gamma=gamma, max_new=max_new,
                                            max_len=max_len, top_n=top_n))
    if not (resume and os.path.isfile(path)):
      data = collect_item(pair, item, gamma=gamma, max_new=max_new, max_len=max_len,
                          top_n=top_n, progress=progress, kv_cache_dir=kv_cache_dir)
      tmp = path + ".tmp.npz"
      np.savez_compressed(tmp, **data)
      os.replace(tmp, path)
    paths.append(path)
  return paths
