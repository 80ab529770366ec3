"""The draft's int8 LM head against its native head on real text, teacher
forced: at every position of a few long real prompts, the draft's argmax
through each head and the target's argmax. The share of positions where
the two draft heads agree bounds how often the int8 head can change a
proposal; the share where each matches the target is the per-token
acceptance a greedy draft would see with a perfect history.

Usage (CPU, the offline Qwen2.5-Coder pair; ~10 min):
  python results/eval/int8_head_agreement.py --out=results/eval/int8_head_agreement.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from dustin_jax.cache import KVCache  # noqa: E402
from dustin_jax.eval.texts import read_text  # noqa: E402
from dustin_jax.profiling.runtime import Pair, text_prompt  # noqa: E402


def argmaxes(model, tokens, chunk, heads=("native",)):
  """{head: argmax [T]} of the teacher-forced logits of `tokens` (one
  sequence), chunk by chunk through the model's cache."""
  modules = {h: nnx.merge(*model.with_draft_head(h)[1:]) for h in heads}
  cache = KVCache.init(model.cfg, 1, max_len=len(tokens) + 8)
  step = jax.jit(lambda s, c, t: nnx.merge(model.graphdef, s)(t, c)[:2])
  out = {h: [] for h in heads}
  state = model.state
  for s in range(0, len(tokens), chunk):
    part = jnp.asarray(tokens[s:s + chunk], jnp.int32)[None]
    hidden, cache = step(state, cache, part)
    cache = cache.commit(jnp.full((1,), part.shape[1]))
    for h, m in modules.items():
      out[h].append(np.asarray(jnp.argmax(m.logits(hidden[0]), -1)))
  return {h: np.concatenate(v) for h, v in out.items()}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="results/eval/int8_head_agreement.json")
  ap.add_argument("--n_prompts", type=int, default=3)
  ap.add_argument("--ctx", type=int, default=4096)
  ap.add_argument("--text", default="python-stdlib")
  ap.add_argument("--chunk", type=int, default=512)
  args = ap.parse_args()
  t0 = time.perf_counter()
  pair = Pair("real")
  text = read_text(args.text, progress=False)
  rng = np.random.default_rng(0)
  prompts = [text_prompt(pair.tokenizer, text, args.ctx, rng) for _ in range(args.n_prompts)]
  counts = dict(positions=0, heads_agree=0, native_matches_target=0, int8_matches_target=0)
  for tokens, _ in prompts:
    d = argmaxes(pair.draft, tokens, args.chunk, heads=("native", "int8"))
    t = argmaxes(pair.target, tokens, args.chunk)["native"]
    counts["positions"] += len(tokens)
    counts["heads_agree"] += int(np.sum(d["native"] == d["int8"]))
    counts["native_matches_target"] += int(np.sum(d["native"] == t))
    counts["int8_matches_target"] += int(np.sum(d["int8"] == t))
    print(json.dumps(counts), flush=True)
  n = counts["positions"]
  result = dict(model=pair.model_name, text=args.text, offsets=[o for _, o in prompts],
                ctx=args.ctx, dtype=pair.draft.cfg.dtype, **counts,
                heads_agree_share=counts["heads_agree"] / n,
                native_acceptance=counts["native_matches_target"] / n,
                int8_acceptance=counts["int8_matches_target"] / n,
                seconds=round(time.perf_counter() - t0, 1))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
