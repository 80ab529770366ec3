r"""Offline SRH profiling (Algorithm 1) of a target/draft pair.

  python -m scripts.profile_srh            # the real Qwen2.5-Coder 1.5B/0.5B pair
  python -m scripts.profile_srh --pair=tiny --contexts=96 --n_items=2 --max_new=8 \
      --budget=32 --out=/tmp/srh.json --cache_dir=/tmp/calib    # smoke run

1. calibration items: `--n_items` prompts per context of `--contexts`
   tokens, cut from the texts of `--texts` in turn at offsets drawn from
   `--seed` (line starts);
2. collection (dustin_jax/profiling/collect.py): lossless greedy speculative
   decoding of `--max_new` tokens per item, recording per verify step the
   target's full attention and every draft/target head's signal; one npz
   per item in `--cache_dir` (`--resume` skips those already there);
3. the greedy search (dustin_jax/profiling/search.py) -> the SRH JSON
   (`--out`, format of dustin_jax/selection/srh.py) and a PNG of ARR vs the
   number of heads and ARR vs m (`--plot`).
"""

import os
import time

from absl import app
from absl import flags
import numpy as np

from dustin_jax.assets import cache_root
from dustin_jax.eval.texts import read_text
from dustin_jax.profiling import collect, search
from dustin_jax.profiling.collect import CalibItem
from dustin_jax.profiling.runtime import Pair, text_prompt
from dustin_jax.selection.srh import SRHConfig, load_srh, save_srh
from scripts.benchmarking import compile_cache_from_flag

FLAGS = flags.FLAGS
flags.DEFINE_enum("pair", "real", ["real", "tiny"], "model pair (tiny: random smoke models)")
flags.DEFINE_list("texts", ["web-bible", "python-stdlib"], "calibration texts, used in turn")
flags.DEFINE_list("contexts", ["4096"], "calibration context lengths (tokens)")
flags.DEFINE_integer("n_items", 4, "calibration items per context")
flags.DEFINE_integer("max_new", 32, "tokens generated per item")
flags.DEFINE_integer("gamma", 4, "draft tokens per step")
flags.DEFINE_integer("budget", 512, "KV budget of the verification set")
flags.DEFINE_integer("n_sink", 16, "attention-sink rows")
flags.DEFINE_integer("n_window", 64, "local-window rows")
flags.DEFINE_list("windows", [], "other local-window sizes to try for the final heads "
                  "(m re-optimised for each; the best ARR is written)")
flags.DEFINE_integer("head_budget", 8, "most SRHs (draft + target heads) to choose")
flags.DEFINE_integer("heads_per_layer", 2, "heads a layer candidate brings (its best by "
                     "retrieval score)")
flags.DEFINE_float("eps", 1e-3, "stop when adding a candidate gains less ARR than this")
flags.DEFINE_integer("top_n", 1024, "rows kept per head and step in the cache")
flags.DEFINE_integer("seed", 1234, "seed of the calibration offsets")
flags.DEFINE_string("out", "", "SRH JSON ('' = configs/srh/<target>__<draft>.json)")
flags.DEFINE_string("plot", "results/eval/srh_profile.png", "PNG ('' to skip)")
flags.DEFINE_string("cache_dir", "", "npz cache ('' = <dustin_jax cache>/calib)")
flags.DEFINE_bool("resume", True, "reuse items already in the cache")
flags.DEFINE_bool("progress", True, "progress bars")


def calibration_items(tok, texts, contexts, n_items, seed):
  rng = np.random.default_rng(seed)
  items = []
  loaded = {}
  for ctx in contexts:
    for i in range(n_items):
      name = texts[i % len(texts)]
      text = loaded.setdefault(name, read_text(name, progress=False))
      ids, off = text_prompt(tok, text, ctx, rng)
      items.append(CalibItem(name, off, ids))
  return items


def main(argv):
  del argv
  compile_cache_from_flag()
  t_all = time.perf_counter()
  pair = Pair(FLAGS.pair, progress=FLAGS.progress)   # weights only if an item is not cached
  contexts = [int(c) for c in FLAGS.contexts]
  items = calibration_items(pair.tokenizer, FLAGS.texts, contexts, FLAGS.n_items, FLAGS.seed)
  max_len = max(contexts) + FLAGS.max_new + FLAGS.gamma + 2
  cache_dir = FLAGS.cache_dir or str(cache_root() / "calib")
  t0 = time.perf_counter()
  paths = collect.collect(pair, items, cache_dir, gamma=FLAGS.gamma, max_new=FLAGS.max_new,
                          max_len=max_len, top_n=FLAGS.top_n, resume=FLAGS.resume,
                          progress=FLAGS.progress,
                          kv_cache_dir=str(cache_root() / "kv") if FLAGS.pair == "real" else None)
  collect_s = time.perf_counter() - t0
  data = search.load_calib(paths)
  print(f"calibration: {len(items)} items, {data.n_steps} verify steps, "
        f"{collect_s:.1f} s", flush=True)
  res = search.greedy_search(data, budget=FLAGS.budget, n_sink=FLAGS.n_sink,
                             n_window=FLAGS.n_window, head_budget=FLAGS.head_budget,
                             heads_per_layer=FLAGS.heads_per_layer, eps=FLAGS.eps,
                             windows=[int(x) for x in FLAGS.windows], progress=FLAGS.progress)
  print(f"search: {res.seconds:.1f} s; ARR {res.arr:.4f} with m={res.m}, n_window="
        f"{res.n_window}, draft heads "
        f"{res.draft_heads}, target heads {res.target_heads}", flush=True)
  out = FLAGS.out or os.path.join("configs", "srh",
                                  f"{pair.target_name}__{pair.draft_name}.json")
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  extra = dict(
      reduce="sum", pool=1,
      calibration=dict(
          items=[dict(text=it.text, char_offset=it.offset, context=len(it.tokens),
                      n_steps=d["n_steps"], tau=round(d["tau"], 4))
                 for it, d in zip(items, data.items)],
          texts=list(FLAGS.texts), contexts=contexts, n_items=len(items),
          n_steps=data.n_steps, max_new=FLAGS.max_new, gamma=FLAGS.gamma, seed=FLAGS.seed,
          sampling="greedy", trajectory="lossless (full verification)", top_n=FLAGS.top_n),
      search=dict(head_budget=FLAGS.head_budget, heads_per_layer=FLAGS.heads_per_layer,
                  eps=FLAGS.eps, history=res.history, m_curve=res.m_curve,
                  window_curve=res.window_curve,
                  baselines=res.baselines,
                  best_heads=dict(draft=res.head_scores["draft"][:10],
                                  target=res.head_scores["target"][:10])),
      runtime_s=dict(collect_when_recorded=round(sum(d["seconds"] for d in data.items), 1),
                     collect_this_run=round(collect_s, 1), search=round(res.seconds, 1),
                     total_this_run=round(time.perf_counter() - t_all, 1)),
      arr_definition="dustin_jax/selection/arr.py; mean over calibration steps")
  srh = SRHConfig(target=pair.target_name, draft=pair.draft_name,
                  draft_heads=res.draft_heads, target_heads=res.target_heads, m=res.m,
                  n_sink=FLAGS.n_sink, n_window=res.n_window, budget=FLAGS.budget,
                  arr=round(res.arr, 6), extra=extra)
  save_srh(srh, out)
  load_srh(out, *pair.configs())   # round trip: the policies can read it
  print(f"wrote {out}", flush=True)
  if FLAGS.plot:
    os.makedirs(os.path.dirname(FLAGS.plot) or ".", exist_ok=True)
    search.plot_profile(res, FLAGS.plot, title=f"{pair.model_name}: budget {FLAGS.budget}, "
                        f"{data.n_steps} calibration steps, ARR {res.arr:.3f}")
    print(f"wrote {FLAGS.plot}", flush=True)
  print(f"total {time.perf_counter() - t_all:.1f} s", flush=True)


if __name__ == "__main__":
  app.run(main)
