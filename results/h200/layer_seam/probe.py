"""Probe: one draft pass of Qwen2.5-0.5B shapes (24 layers, a streaming
window of 16 + 496 rows) with the seams between attentions as one resident
kernel per layer (`draft_mlp="seam"`; `"seam_mosaic"`: with the Mosaic GPU
window attention) against the package's default draft (`"kernel_prefetch"`:
six kernels between attentions), in one process. Not part of the package.

Wall clock of 30 queued passes (`scripts.benchmarking.queued_steps`: jit,
the cache donated and fed back so that its rows are written in place,
warm-up excluded, fastest of 3). Variants: the seam kernel's weight slots
(MAX_STAGES) and its rows, the pass's padded to a multiple of `--pad_rows`
(`Decoder.seam_rows`).

Usage (on the GPU): python results/h200/layer_seam/probe.py --out=$OUT
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from configs.shapes import PAIRS  # noqa: E402
from dustin_jax.config import ModelConfig  # noqa: E402
from kernels.layer_seam import gpu as seam_gpu  # noqa: E402
from scripts.benchmarking import queued_steps, random_cache, random_model  # noqa: E402


def timed(fn, state, tokens, cache, repeats=30):
  """us per call of `fn(state, tokens, cache) -> (hidden, cache)`, the
  cache donated and fed back (written in place, as in a decode):
  `queued_steps` of 30 calls, fastest of 3, warm-up excluded. Returns (us,
  hidden, cache)."""
  def step(cache):
    hidden, cache = fn(state, tokens, cache)
    return cache, hidden
  cache, _, _ = queued_steps(step, cache, 2)
  best = []
  for _ in range(3):
    cache, wall, _ = queued_steps(step, cache, repeats)
    best.append(wall / repeats)
  hidden, cache = fn(state, tokens, cache)
  return min(best) * 1e6, hidden, cache


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--context", type=int, default=4096)
  ap.add_argument("--stages", default="10,6,4")
  ap.add_argument("--pad_rows", default="8", help="seam rows padded to multiples of each")
  ap.add_argument("--tokens", default="1,2", help="tokens per sequence of each timed pass")
  ap.add_argument("--mosaic", type=int, default=1, help="0: no seam_mosaic variant")
  args = ap.parse_args()
  cfg = ModelConfig.from_hf(dict(PAIRS["qwen7b"][1]), dtype="bfloat16")
  base = random_model(cfg, 1)
  models = {mode: base.with_draft_mlp(mode)
            for mode in ("kernel_prefetch", "seam", "seam_mosaic")}
  cache = random_cache(cfg, args.batch, args.context + 64, args.context, 13)
  window = (16, 496)
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, batch=args.batch,
                context=args.context, layers=cfg.num_layers, runs=[])

  def forward_fn(model):
    from flax import nnx

    @functools.partial(jax.jit, donate_argnums=(2,))
    def fwd(state, tokens, cache):
      module = nnx.merge(model.graphdef, state)
      hidden, cache, _ = module(tokens, cache, window=window)
      return hidden, cache
    return fwd

  def padded(model, rows):
    from flax import nnx
    module = nnx.merge(model.graphdef, model.state)
    module.seam_rows = rows
    return type(model)(model.cfg, *nnx.split(module))

  pads = [int(p) for p in args.pad_rows.split(",")]
  outputs = {}
  for t in (int(x) for x in args.tokens.split(",")):
    tokens = jax.random.randint(jax.random.key(t), (args.batch, t), 0, cfg.vocab_size)
    stages = [int(s) for s in args.stages.split(",")]
    # pad None: the model as made (`Decoder.seam_rows`'s default)
    variants = ([("kernel_prefetch", None, None)]
                + [("seam", s, pad) for s in stages for pad in pads]
                + [("seam_mosaic", stages[0], None)] * bool(args.mosaic))
    for mode, stages, pad in variants:
      if stages is not None:
        seam_gpu.MAX_STAGES = stages
        jax.clear_caches()
      model = models[mode] if pad is None else padded(models[mode], pad)
      fn = forward_fn(model)
      try:
        us, hidden, cache = timed(fn, model.state, tokens, cache)
      except Exception as e:  # a variant that fails is reported, not fatal
        result["runs"].append(dict(mode=mode, stages=stages, pad_rows=pad, rows=args.batch * t,
                                   error=f"{type(e).__name__}: {str(e)[:1500]}"))
        print(mode, stages, "failed:", type(e).__name__, str(e)[:400], flush=True)
        continue
      out = np.asarray(hidden.astype(jnp.float32))
      outputs.setdefault((mode, t), out)
      rec = dict(mode=mode, stages=stages, pad_rows=pad, rows=args.batch * t, us_per_pass=us,
                 us_per_layer=us / cfg.num_layers)
      if mode != "kernel_prefetch":
        ref = outputs[("kernel_prefetch", t)]
        rec["max_abs_diff_vs_kernel_prefetch"] = float(np.max(np.abs(out - ref)))
        rec["max_abs_kernel_prefetch"] = float(np.max(np.abs(ref)))
      result["runs"].append(rec)
      print(json.dumps(rec), flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "probe.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
