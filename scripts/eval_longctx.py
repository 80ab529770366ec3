r"""Long-context evaluation of the selection policies on a target/draft pair.

  # the tau table (results/eval/tau.json, read by scripts/bench_e2e.py):
  # budget 512, gamma 2/4/6, one 4k context; then with the streaming draft
  # cache the benchmarks' fast step runs
  python -m scripts.eval_longctx --only_tau --policies=full,dustin,streaming,quest
  python -m scripts.eval_longctx --only_tau --policies=dustin --draft_kv=streaming

  # the main evaluation (results/eval/longctx.json + README.md + PNG)
  python -m scripts.eval_longctx --contexts=4096,8192 --budgets=512

  # smoke run on tiny random models (tests/test_eval_smoke.py)
  python -m scripts.eval_longctx --pair=tiny --contexts=96 --budgets=16 ...

Per context, one prefill per batch of prompts (a long-text continuation
batch, then one batch per task); every policy and budget starts from a copy
of the caches and runs greedy speculative decoding (gamma = 4 unless
--gamma), the target verifying against the policy's I_verify with
`StepOptions(measure_arr=True)`, so the ARR of the set the policy actually
used is measured at every step. REPORT_NOTES below defines the metrics; it
heads the generated README.md.

Resumable: records already in the output JSON (same model, policy, budget,
context, task, metric, seed and the same items: `source`) are skipped; a
record of other items (say, another `--n_prompts`) is measured again and
replaced, `full` first, as the agreement reference.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import numpy as np

from dustin_jax.assets import cache_root
from dustin_jax.decoding import DRAFT_HEADS
from dustin_jax.eval import tasks as tasklib
from dustin_jax.eval.texts import read_text
from dustin_jax.profiling.runtime import (QWEN_EOS, load_pair, prefill_base, release_host_memory,
                                          run_policy, sparse_ppl, text_prompt)
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.selection.srh import load_srh
from dustin_jax.speculative.step import SpecConfig
from scripts.benchmarking import (compile_cache_from_flag, pyplot, save_figure,
                                  tau_draft_cache, write_json)

FLAGS = flags.FLAGS
flags.DEFINE_enum("pair", "real", ["real", "tiny"], "real: the offline Qwen2.5-Coder "
                  "1.5B/0.5B pair; tiny: random tiny models (smoke tests)")
flags.DEFINE_bool("only_tau", False, "only the tau table (--tau_out)")
flags.DEFINE_string("tau_out", "results/eval/tau.json", "output of --only_tau")
flags.DEFINE_list("policies", ["full", "dustin", "dustin_target", "dustin_draft", "streaming",
                               "quest", "oracle"], "policies")
flags.DEFINE_list("budgets", ["512"], "KV budgets")
flags.DEFINE_list("contexts", ["4096"], "context lengths in tokens")
flags.DEFINE_list("gammas", ["2", "4", "6"], "gammas of --only_tau")
flags.DEFINE_enum("draft_kv", "full", ["full", "streaming"], "the draft's cache in --only_tau: "
                  "full, or streaming (--draft_sink first and --draft_window last rows, "
                  "as the benchmarks' fast step runs it)")
flags.DEFINE_enum("draft_head", "native", list(DRAFT_HEADS), "the draft's LM head in "
                  "--only_tau: its own matrix or int8 rows with per-row scales")
flags.DEFINE_integer("draft_sink", SpecConfig().draft_sink, "sink rows of a streaming draft cache")
flags.DEFINE_integer("draft_window", SpecConfig().draft_window, "recent rows of a streaming draft cache")
flags.DEFINE_integer("gamma", 4, "gamma of the main evaluation")
flags.DEFINE_list("tasks", ["passkey", "needle", "multikey", "qa", "code"],
                  "tasks of dustin_jax/eval/tasks.py ('' for none)")
flags.DEFINE_integer("n_items", 2, "items per task and context (one batch)")
flags.DEFINE_integer("n_prompts", 3, "long-text continuation prompts per context (one batch)")
flags.DEFINE_integer("max_new", 48, "tokens generated per continuation prompt")
flags.DEFINE_string("text", "python-stdlib", "long text of the continuation prompts / tau")
flags.DEFINE_integer("ppl_tokens", 60, "real tokens after each continuation prompt scored "
                     "teacher-forced (sparse perplexity; a multiple of gamma + 1 is used)")
flags.DEFINE_string("srh_file", "", "SRH JSON for the dustin* policies ('' = "
                    "configs/srh/<target>__<draft>.json if present, else default heads)")
flags.DEFINE_string("out_dir", "results/eval", "output directory")
flags.DEFINE_string("kv_cache_dir", "auto", "prefilled KV caches are saved/reused here "
                    "('auto' = <dustin_jax cache>/kv for the real pair, '' = never)")
flags.DEFINE_string("out_name", "longctx.json", "records file in out_dir")
flags.DEFINE_integer("seed", 0, "seed of the prompts and tasks")
flags.DEFINE_bool("progress", True, "progress bars")
flags.DEFINE_bool("report", True, "write README.md and the PNG from the records")


# ------------------------------------------------------------------ helpers
def kv_cache_dir() -> str | None:
  if FLAGS.kv_cache_dir == "auto":
    return str(cache_root() / "kv") if FLAGS.pair == "real" else None
  return FLAGS.kv_cache_dir or None


def srh_path(pair, flag: str) -> str:
  if flag:
    return flag
  p = os.path.join("configs", "srh", f"{pair.target_name}__{pair.draft_name}.json")
  return p if os.path.isfile(p) else ""


def make_policy(name: str, budget: int, pair, srh_file: str):
  """The policy `name` at `budget`, as a run config would build it; the
  dustin* policies read `srh_file` (heads, m, sink/window; m is scaled to
  the budget when the file was profiled at another one)."""
  n_sink, n_window = 16, 64
  if budget < 4 * (n_sink + n_window):   # tiny budgets (smoke tests)
    n_sink, n_window = max(1, budget // 16), max(8, budget // 8)
  m = (budget - n_sink - n_window) // 2
  if srh_file:
    srh = load_srh(srh_file)
    if budget == srh.budget:
      n_sink, n_window = srh.n_sink, srh.n_window
    free = budget - n_sink - n_window
    srh_free = srh.budget - srh.n_sink - srh.n_window
    m = min(free, round(srh.m * free / max(srh_free, 1)))
  config = dict(policy=name, budget=budget, srh_file=srh_file, n_sink=n_sink,
                n_window=n_window, m=m)
  return policy_from_config(config, pair.target.cfg, pair.draft.cfg)


def load_records(path: str) -> list[dict]:
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  return []


def continuation_prompts(tok, text_name: str, n: int, ctx: int, seed: int):
  """`n` prompts of exactly `ctx` tokens from the real text `text_name`,
  starting at line starts chosen by `seed`. Returns (prompts, char offsets)."""
  text = read_text(text_name, progress=False)
  rng = np.random.default_rng(seed)
  prompts, offsets = zip(*(text_prompt(tok, text, ctx, rng) for _ in range(n)))
  return list(prompts), list(offsets)


def agreement(tokens, ref_tokens) -> tuple[float, int]:
  """(share of the reference positions that `tokens` matches, reference
  positions) over a batch."""
  match = sum(x == y for a, f in zip(tokens, ref_tokens) for x, y in zip(a, f))
  total = sum(len(f) for f in ref_tokens)
  return match / max(total, 1), total


# --------------------------------------------------------------- tau table
def run_tau(pair):
  budget = int(FLAGS.budgets[0])
  ctx = int(FLAGS.contexts[0])
  gammas = [int(g) for g in FLAGS.gammas]
  # the same prompts as the main evaluation's continuation batch (same seed,
  # n_prompts, ppl_tokens): its prefilled caches are reused from the KV cache
  prompts, offsets = continuation_prompts(pair.tokenizer, FLAGS.text, FLAGS.n_prompts,
                                          ctx + FLAGS.ppl_tokens, FLAGS.seed)
  prompts = [p[:ctx] for p in prompts]
  srh = srh_path(pair, FLAGS.srh_file)
  t0 = time.perf_counter()
  base = prefill_base(pair, prompts, ctx + FLAGS.max_new + max(gammas) + 2,
                      progress=FLAGS.progress, cache_dir=kv_cache_dir())
  print(f"prefill of {len(prompts)} x {ctx} tokens (both models): {base.prefill_s:.1f} s",
        flush=True)
  records = load_records(FLAGS.tau_out)
  done = {(r["policy"], r["gamma"], r["budget"], r["context"], r["model"]) + tau_draft_cache(r)
          for r in records}
  source = (f"{FLAGS.text} char offsets {offsets}, {ctx}-token contexts, {FLAGS.max_new} "
            f"greedy tokens each, batch {len(prompts)}, no EOS stop")
  window = ((FLAGS.draft_sink, FLAGS.draft_window) if FLAGS.draft_kv == "streaming"
            else None)
  draft = dict(draft_kv=FLAGS.draft_kv)
  if window:
    draft.update(draft_sink=window[0], draft_window=window[1])
  if FLAGS.draft_head != "native":
    draft.update(draft_head=FLAGS.draft_head)
    pair.draft = pair.draft.with_draft_head(FLAGS.draft_head)
  for name in FLAGS.policies:
    b = 0 if name == "full" else budget
    heads = f"; heads: {srh or 'default (not profiled)'}" if name.startswith("dustin") else ""
    for gamma in gammas:
      if (name, gamma, b, ctx, pair.model_name) + tau_draft_cache(draft) in done:
        continue
      t1 = time.perf_counter()
      s = run_policy(pair, base, make_policy(name, budget, pair, srh), gamma=gamma,
                     max_new_tokens=FLAGS.max_new, progress=FLAGS.progress,
                     draft_window=window).stats
      records.append(dict(
          policy=name, gamma=gamma, budget=b, tau=s.tau, acceptance=s.acceptance_rate,
          n_steps=s.seq_steps, context=ctx, model=pair.model_name, source=source + heads,
          decode_s=round(time.perf_counter() - t1, 2), **draft))
      write_json(FLAGS.tau_out, records)
      print(f"{name:14s} gamma={gamma} budget={b} draft {FLAGS.draft_kv}: tau={s.tau:.3f} "
            f"acc={s.acceptance_rate:.3f} ({time.perf_counter() - t1:.1f} s)", flush=True)
  print(f"tau table: {time.perf_counter() - t0:.1f} s -> {FLAGS.tau_out}", flush=True)


# ------------------------------------------------------------ main evaluation
def eval_batches(pair, ctx: int) -> list[dict]:
  """The batches of one context: the long-text continuation (with the real
  tokens after each prompt for the sparse perplexity), then each task."""
  batches = []
  if FLAGS.n_prompts:
    prompts, offsets = continuation_prompts(pair.tokenizer, FLAGS.text, FLAGS.n_prompts,
                                            ctx + FLAGS.ppl_tokens, FLAGS.seed)
    batches.append(dict(
        task=f"continuation:{FLAGS.text}", prompts=[p[:ctx] for p in prompts],
        refs=[p[ctx:] for p in prompts], items=None, max_new=FLAGS.max_new, eos=(),
        source=f"{FLAGS.text} char offsets {offsets}, {FLAGS.max_new} greedy tokens, "
               f"no EOS stop; ppl over the next {FLAGS.ppl_tokens} real tokens"))
  for task in filter(None, FLAGS.tasks):
    items = tasklib.build_task(task, pair.tokenizer, ctx, FLAGS.n_items, seed=FLAGS.seed)
    batches.append(dict(
        task=task, prompts=[list(it.prompt_ids) for it in items], refs=None, items=items,
        max_new=max(it.max_new_tokens for it in items),
        eos=QWEN_EOS if FLAGS.pair == "real" else (),
        source=f"dustin_jax/eval/tasks.py {task} on {tasklib.DEFAULT_TEXT[task]}, "
               f"{len(items)} items, seed {FLAGS.seed}, scorer {items[0].scorer}"))
  return batches


def record_key(r: dict) -> tuple:
  return r["model"], r["policy"], r["budget"], r["context"], r["task"], r["metric"], r["seed"]


def run_eval(pair):
  out_path = os.path.join(FLAGS.out_dir, FLAGS.out_name)
  outputs_path = os.path.join(FLAGS.out_dir, FLAGS.out_name.replace(".json", "_outputs.json"))
  records = {record_key(r): r for r in load_records(out_path)}
  outputs = {o["key"]: o for o in load_records(outputs_path)}   # generated tokens, per run
  srh = srh_path(pair, FLAGS.srh_file)
  gamma, seed, model = FLAGS.gamma, FLAGS.seed, pair.model_name
  runs = [("full", 0)] if "full" in FLAGS.policies else []   # full once, at budget 0
  runs += [(p, int(b)) for b in FLAGS.budgets for p in FLAGS.policies if p != "full"]
  t_start = time.perf_counter()

  def missing(policy, budget, ctx, task, metrics, source):
    """The metrics without a record of these items (a record's `source` names them)."""
    return [m for m in metrics
            if records.get((model, policy, budget, ctx, task, m, seed), {}).get("source") != source]

  for ctx in [int(c) for c in FLAGS.contexts]:
    max_len = ctx + max(FLAGS.max_new, FLAGS.ppl_tokens, *tasklib.MAX_NEW.values()) + gamma + 2
    for batch in eval_batches(pair, ctx):
      task, src = batch["task"], batch["source"]
      gen_metrics = ["tau", "acceptance", "agreement", "arr"]
      gen_metrics += [] if batch["refs"] else ["accuracy"]
      tf_metrics = ["ppl", "tf_agreement"] if batch["refs"] else []
      metrics = gen_metrics + tf_metrics
      todo = [(p, b) for p, b in runs if missing(p, b, ctx, task, metrics, src)]
      if not todo:
        continue
      base = prefill_base(pair, batch["prompts"], max_len, progress=FLAGS.progress,
                          cache_dir=kv_cache_dir())
      print(f"[{ctx}] {task}: prefill {len(batch['prompts'])} x {ctx} tokens "
            f"{base.prefill_s:.1f} s", flush=True)
      full_key = f"{model}|full|0|{ctx}|{task}|{seed}"
      if ("full", 0) not in todo and (full_key not in outputs or (
          tf_metrics and "tf_top1" not in outputs[full_key])):
        todo.insert(0, ("full", 0))   # its tokens are the agreement references
      for policy_name, budget in todo:
        if base is None:   # reload the prefilled rows from the disk cache (seconds)
          base = prefill_base(pair, batch["prompts"], max_len, cache_dir=kv_cache_dir())
        policy = make_policy(policy_name, max(budget, 1) if policy_name != "full" else 512,
                             pair, srh)
        t1 = time.perf_counter()
        need = missing(policy_name, budget, ctx, task, metrics, src)
        key = f"{model}|{policy_name}|{budget}|{ctx}|{task}|{seed}"
        line = f"[{ctx}] {task:28s} {policy_name:14s} b={budget:5d}"

        def put(metric, value, n):
          if metric in need:
            r = dict(model=model, policy=policy_name, budget=budget, context=ctx, task=task,
                     metric=metric, value=value, n=n, seed=seed, gamma=gamma, source=src)
            records[record_key(r)] = r

        if set(need) & set(gen_metrics) or key not in outputs:
          res = run_policy(pair, base, policy, gamma=gamma, max_new_tokens=batch["max_new"],
                           eos_ids=batch["eos"], measure_arr=policy_name != "full",
                           seed=seed, progress=FLAGS.progress)
          texts = [pair.tokenizer.decode(t) for t in res.tokens]
          outputs[key] = {**outputs.get(key, {}), "key": key, "tokens": res.tokens,
                          "texts": texts}
          s, arr = res.stats, 1.0 if policy_name == "full" else res.arr
          put("tau", s.tau, s.seq_steps)
          put("acceptance", s.acceptance_rate, s.seq_steps * gamma)
          put("arr", arr, res.arr_n or s.seq_steps)
          ref = outputs.get(full_key, {}).get("tokens")
          if ref is not None:
            put("agreement", *agreement(res.tokens, ref))
          line += f" tau={s.tau:.3f} arr={arr if arr is not None else 1.0:.3f}"
          if batch["items"] is not None:
            scores = [it.score(txt) for it, txt in zip(batch["items"], texts)]
            put("accuracy", float(np.mean(scores)), len(scores))
            line += f" acc={np.mean(scores):.3f}"
        if tf_metrics and (set(need) & set(tf_metrics) or "tf_top1" not in outputs[key]):
          t2 = time.perf_counter()
          ppl, n, top1 = sparse_ppl(pair, base, policy, batch["refs"], gamma, return_top1=True)
          outputs[key]["tf_top1"] = top1
          put("ppl", ppl, n)
          ref = outputs.get(full_key, {}).get("tf_top1")
          if ref is not None:
            put("tf_agreement", *agreement(top1, ref))
          line += f" ppl={ppl:.3f} ({time.perf_counter() - t2:.1f} s)"
        write_json(out_path, list(records.values()))
        write_json(outputs_path, list(outputs.values()))
        if kv_cache_dir():  # hold only the run's copy, not the base too (host memory)
          base = None
        release_host_memory()
        print(f"{line} ({time.perf_counter() - t1:.1f} s)", flush=True)
      del base
  print(f"evaluation: {time.perf_counter() - t_start:.1f} s -> {out_path}", flush=True)
  if FLAGS.report:
    write_report(list(records.values()), FLAGS.out_dir)


# ------------------------------------------------------------------ report
REPORT_NOTES = """\
Generated by `scripts/eval_longctx.py` from `longctx.json` (one record per model, policy,
budget, context, task, metric and seed; `source` names the items measured). Greedy speculative
decoding, gamma = {gamma}, every policy starting from a copy of the same prefilled caches;
`full` verifies against the whole cache (budget 0), the others against their budgeted set.
Metrics other than accuracy average a row's records weighted by their counts `n`.

* tau: accepted drafts + 1 per verify step; acceptance: accepted / (gamma * steps).
* agreement: share of `full`'s generated tokens reproduced at the same position (a greedy
  divergence cascades); ARR: attention recovery rate of the sets the policy verified against
  (dustin_jax/selection/arr.py).
* ppl: teacher-forced perplexity of the real continuation of the long-text prompts, each block
  of gamma + 1 tokens verified against the policy's set; tf agreement: share of those positions
  where the target's argmax equals its argmax under `full`.
* accuracy: task score (dustin_jax/eval/tasks.py), the mean of the row's task records, then
  per task; with few items per task, one answer moves a task by 1/n. `seeds`: the item sets
  (prompts and task items) a row averages.
"""
# record metric -> table column
TABLE_METRICS = {"tau": "tau", "acceptance": "acceptance", "agreement": "agreement",
                 "tf_agreement": "tf agreement", "arr": "ARR", "ppl": "ppl",
                 "accuracy": "accuracy"}
POLICY_ORDER = ["full", "dustin", "dustin_draft", "dustin_target", "quest", "streaming", "oracle"]


def mean_value(rs, metric):
  """The mean of the records' values: over tasks for accuracy, else
  weighted by each record's count `n`; None without records."""
  if not rs:
    return None
  if metric == "accuracy":
    return float(np.mean([r["value"] for r in rs]))
  w = np.asarray([max(r["n"], 1) for r in rs], float)
  return float(np.sum(w * [r["value"] for r in rs]) / w.sum())


def results_table(rs) -> list[str]:
  """One row per (policy, budget) of the records `rs` (one model and context)."""
  tasks = sorted({r["task"] for r in rs if not r["task"].startswith("continuation")})
  columns = ["policy", "budget", "seeds", *TABLE_METRICS.values(), *tasks]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  fmt = lambda v, digits: "" if v is None else f"{v:.{digits}f}"
  rank = lambda pol: POLICY_ORDER.index(pol) if pol in POLICY_ORDER else len(POLICY_ORDER)
  for pol, b in sorted({(r["policy"], r["budget"]) for r in rs}, key=lambda k: (k[1], rank(k[0]))):
    row_rs = [r for r in rs if r["policy"] == pol and r["budget"] == b]
    cell = lambda metric, task=None: mean_value(
        [r for r in row_rs if r["metric"] == metric and task in (None, r["task"])], metric)
    seeds = ",".join(str(s) for s in sorted({r["seed"] for r in row_rs}))
    row = ([pol, str(b), seeds] + [fmt(cell(m), 3) for m in TABLE_METRICS]
           + [fmt(cell("accuracy", t), 2) for t in tasks])
    lines.append("| " + " | ".join(row) + " |")
  return lines


def write_report(records, out_dir):
  """README.md (the notes and one table per model and context) and
  longctx.png (tau and task accuracy vs budget per context)."""
  lines = ["# Long-context evaluation", "",
           REPORT_NOTES.format(gamma=records[0]["gamma"] if records else "?")]
  for model in sorted({r["model"] for r in records}):
    for ctx in sorted({r["context"] for r in records if r["model"] == model}):
      rs = [r for r in records if r["model"] == model and r["context"] == ctx]
      lines += [f"## {model}, context {ctx}", "", *results_table(rs), ""]
  with open(os.path.join(out_dir, "README.md"), "w") as f:
    f.write("\n".join(lines).rstrip("\n") + "\n")
  plot_report(records, os.path.join(out_dir, "longctx.png"))


def plot_report(records, path):
  ctxs = sorted({r["context"] for r in records})
  if not ctxs:
    return
  fig, axes = pyplot().subplots(2, len(ctxs), figsize=(5 * len(ctxs), 7), squeeze=False)
  for j, ctx in enumerate(ctxs):
    for i, metric in enumerate(("tau", "accuracy")):
      ax = axes[i, j]
      rs = [r for r in records if r["context"] == ctx and r["metric"] == metric]
      if metric == "tau" and any(r["task"].startswith("continuation") for r in rs):
        rs = [r for r in rs if r["task"].startswith("continuation")]   # at every budget
      budgets = sorted({r["budget"] for r in rs if r["budget"] > 0})
      for pol in POLICY_ORDER:
        at = lambda b: mean_value([r for r in rs if r["policy"] == pol and r["budget"] == b],
                                  metric)
        pts = [(b, at(b)) for b in budgets if at(b) is not None]
        if pol == "full" and at(0) is not None:
          ax.axhline(at(0), color="k", ls="--", lw=1, label="full")
        elif pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=pol, ms=4)
      ax.set_xscale("log", base=2)
      ax.set_xlabel("KV budget")
      ax.set_ylabel(metric)
      ax.set_title(f"context {ctx}: " + ("tau (long-text continuation)" if metric == "tau"
                                          else "task accuracy (mean over tasks)"))
      ax.grid(alpha=0.3)
      if i == 0 and j == 0:
        ax.legend(fontsize=7)
  save_figure(fig, path, dpi=100)


def main(argv):
  del argv
  compile_cache_from_flag()
  t0 = time.perf_counter()
  pair = load_pair(FLAGS.pair, progress=FLAGS.progress)
  print(f"loaded {pair.model_name} in {time.perf_counter() - t0:.1f} s", flush=True)
  if FLAGS.only_tau:
    run_tau(pair)
  else:
    run_eval(pair)


if __name__ == "__main__":
  app.run(main)
