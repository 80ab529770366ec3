r"""Long-context evaluation of the selection policies on a target/draft pair.

  # the early tau table (results/eval/tau.json): full, dustin, streaming,
  # quest at budget 512, gamma 2/4/6, one 4k python-stdlib context
  python -m scripts.eval_longctx --only_tau

  # the main evaluation (results/eval/longctx.json + README.md + PNG)
  python -m scripts.eval_longctx --contexts=4096,8192 --budgets=512

  # smoke run on tiny random models (tests/test_eval_smoke.py)
  python -m scripts.eval_longctx --pair=tiny --contexts=96 --budgets=16 ...

Per context, ONE prefill per batch of prompts; every policy and budget then
starts from a copy of the caches. Decoding is greedy speculative decoding
(gamma = 4 unless --gamma), the target verifying against each policy's
I_verify (the step with `StepOptions(measure_arr=True)`, so the ARR of the set
the policy actually used is measured at every step against the target's
full attention at the same verify queries).

Metrics (long-format records, see README.md of the output directory):

* tau: mean accepted length (accepted drafts + 1 per verify step);
  acceptance: accepted / (gamma * steps);
* agreement: share of the generated token positions equal to `full`'s
  greedy output (position by position over full's length; a policy that
  stops early counts the missing positions as disagreements);
* arr: Attention Recovery Rate of the policy's verification sets;
* ppl: teacher-forced perplexity of a real long text with sparse
  verification (see `sparse_ppl`);
* tf_agreement: in that teacher-forced pass, the share of positions where
  the target's argmax under the policy equals its argmax under full
  verification (per-token fidelity without the cascade of a greedy
  divergence, which `agreement` includes);
* accuracy: task score (dustin_jax/eval/tasks.py) of the generated answer.

Resumable: records already in the output JSON (same model, policy, budget,
context, task, metric, seed and the same items: `source`) are skipped; a
record of other items (say, another `--n_prompts`) is measured again and
replaced, `full` first, as the agreement reference.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import time

from absl import app
from absl import flags
import numpy as np

from dustin_jax.assets import cache_root
from dustin_jax.decoding import DecodeStats
from dustin_jax.eval import tasks as tasklib
from dustin_jax.eval.texts import read_text
from dustin_jax.loop import decode_loop
from dustin_jax.profiling.runtime import (QWEN_EOS, fresh_state, load_pair, prefill_base,
                                          release_host_memory, run_policy, text_prompt)
from dustin_jax.selection.policies import policy_from_config
from dustin_jax.selection.srh import load_srh
from dustin_jax.speculative.step import SpecConfig, StepOptions, bind_spec_step
from scripts.benchmarking import compile_cache_from_flag, pyplot, save_figure, write_json

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
    if FLAGS.pair != "real":
      return None
    return str(cache_root() / "kv")
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
  d = dict(policy=name, budget=budget, srh_file=srh_file)
  n_sink, n_window = 16, 64
  if budget < 4 * (n_sink + n_window):   # tiny budgets (smoke tests)
    n_sink, n_window = max(1, budget // 16), max(8, budget // 8)
  d.update(n_sink=n_sink, n_window=n_window)
  free = budget - n_sink - n_window
  if srh_file:
    srh = load_srh(srh_file)
    d.update(n_sink=srh.n_sink if budget == srh.budget else n_sink,
             n_window=srh.n_window if budget == srh.budget else n_window)
    free = budget - d["n_sink"] - d["n_window"]
    srh_free = srh.budget - srh.n_sink - srh.n_window
    d["m"] = min(free, round(srh.m * free / max(srh_free, 1)))
  else:
    d["m"] = free // 2
  return policy_from_config(d, pair.target.cfg, pair.draft.cfg)


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


# --------------------------------------------------------------- tau table
def run_tau(pair) -> list[dict]:
  budget = int(FLAGS.budgets[0])
  ctx = int(FLAGS.contexts[0])
  gammas = [int(g) for g in FLAGS.gammas]
  # the same prompts as the main evaluation's continuation batch (same seed,
  # n_prompts, ppl_tokens): its prefilled caches are reused from the KV cache
  prompts, offsets = continuation_prompts(pair.tokenizer, FLAGS.text, FLAGS.n_prompts,
                                          ctx + FLAGS.ppl_tokens, FLAGS.seed)
  prompts = [p[:ctx] for p in prompts]
  max_len = ctx + FLAGS.max_new + max(gammas) + 2
  srh = srh_path(pair, FLAGS.srh_file)
  t0 = time.perf_counter()
  base = prefill_base(pair, prompts, max_len, progress=FLAGS.progress,
                      cache_dir=kv_cache_dir())
  print(f"prefill of {len(prompts)} x {ctx} tokens (both models): {base.prefill_s:.1f} s",
        flush=True)
  records = load_records(FLAGS.tau_out)
  done = {(r["policy"], r["gamma"], r["budget"], r["context"], r["model"]) for r in records}
  for name in FLAGS.policies:
    for gamma in gammas:
      b = 0 if name == "full" else budget
      if (name, gamma, b, ctx, pair.model_name) in done:
        continue
      policy = make_policy(name, budget, pair, srh)
      t1 = time.perf_counter()
      res = run_policy(pair, base, policy, gamma=gamma, max_new_tokens=FLAGS.max_new,
                       progress=FLAGS.progress)
      s = res.stats
      heads = ("heads: " + (srh if srh else "default (not profiled)")
               if name.startswith("dustin") else "")
      records.append(dict(
          policy=name, gamma=gamma, budget=b, tau=s.tau, acceptance=s.acceptance_rate,
          n_steps=s.seq_steps, context=ctx, model=pair.model_name,
          source=(f"{FLAGS.text} char offsets {offsets}, {ctx}-token contexts, "
                  f"{FLAGS.max_new} greedy tokens each, batch {len(prompts)}, no EOS stop"
                  + (f"; {heads}" if heads else "")),
          decode_s=round(time.perf_counter() - t1, 2)))
      write_json(FLAGS.tau_out, records)
      print(f"{name:14s} gamma={gamma} budget={b}: tau={s.tau:.3f} acc={s.acceptance_rate:.3f} "
            f"({time.perf_counter() - t1:.1f} s)", flush=True)
  print(f"tau table: {time.perf_counter() - t0:.1f} s -> {FLAGS.tau_out}", flush=True)
  return records


def main(argv):
  del argv
  compile_cache_from_flag()
  t0 = time.perf_counter()
  pair = load_pair(FLAGS.pair, progress=FLAGS.progress)
  print(f"loaded {pair.model_name} in {time.perf_counter() - t0:.1f} s", flush=True)
  if FLAGS.only_tau:
    run_tau(pair)
    return
  run_eval(pair)


# ------------------------------------------------------- sparse perplexity
def sparse_ppl(pair, base, policy, refs, gamma, return_top1=False):
  """Teacher-forced perplexity of `refs[b]` (the real continuation of each
  prompt) when every block of gamma+1 tokens is verified with the policy's
  I_verify: the speculative step with `StepOptions(teacher_forced=True)`
  (the draft's guesses replaced by the real tokens; the whole block
  committed). Returns (ppl, n tokens) and, with `return_top1`, the target's
  argmax at every scored position (per sequence)."""
  cfg = SpecConfig(gamma=gamma, policy=policy)
  n_blocks = min(len(r) for r in refs) // (gamma + 1)
  blocks = [np.asarray([r[i * (gamma + 1):(i + 1) * (gamma + 1)] for r in refs], np.int32)
            for i in range(n_blocks)]
  nll, top1 = [], []
  def on_output(out):
    nll.append(np.asarray(out.nll))
    top1.append(np.asarray(out.target_top1))
  step = bind_spec_step(pair.target, pair.draft, cfg, StepOptions(teacher_forced=True))
  decode_loop(step, fresh_state(base, policy, n_blocks * (gamma + 1)), DecodeStats(gamma=gamma),
              inputs=blocks, on_output=on_output)
  total = float(sum(x.sum() for x in nll))
  count = sum(x.size for x in nll)
  top1 = np.concatenate(top1, axis=1).tolist() if top1 else [[] for _ in refs]
  if return_top1:
    return float(np.exp(total / max(count, 1))), count, top1
  return float(np.exp(total / max(count, 1))), count


# ------------------------------------------------------------ main evaluation
def agreement(tokens, ref_tokens) -> tuple[int, int]:
  """(matching positions, reference positions) over a batch."""
  match = total = 0
  for a, f in zip(tokens, ref_tokens):
    total += len(f)
    match += sum(1 for x, y in zip(a, f) if x == y)
  return match, total


def run_eval(pair):
  out_path = os.path.join(FLAGS.out_dir, FLAGS.out_name)
  outputs_path = os.path.join(FLAGS.out_dir, FLAGS.out_name.replace(".json", "_outputs.json"))
  records = load_records(out_path)
  outputs = {o["key"]: o for o in load_records(outputs_path)}
  # a record is done only for the same items: its `source` names them (text
  # offsets, item count), so a rerun with other prompts replaces it
  key_of = lambda r: (r["model"], r["policy"], r["budget"], r["context"], r["task"],
                      r["metric"], r["seed"])
  done = {key_of(r): r["source"] for r in records}
  srh = srh_path(pair, FLAGS.srh_file)
  gamma, seed = FLAGS.gamma, FLAGS.seed
  budgets = [int(b) for b in FLAGS.budgets]
  eos = QWEN_EOS if FLAGS.pair == "real" else ()
  task_names = [t for t in FLAGS.tasks if t]
  t_start = time.perf_counter()

  def runs():
    """(policy, budget) pairs; full once (budget 0)."""
    out = [("full", 0)] if "full" in FLAGS.policies else []
    out += [(p, b) for b in budgets for p in FLAGS.policies if p != "full"]
    return out

  def add(policy, budget, ctx, task, metric, value, n, source, extra=None):
    r = dict(model=pair.model_name, policy=policy, budget=budget, context=ctx, task=task,
             metric=metric, value=value, n=n, seed=seed, gamma=gamma, source=source)
    if extra:
      r.update(extra)
    records[:] = [x for x in records if key_of(x) != key_of(r)] + [r]
    done[key_of(r)] = source

  def missing(policy, budget, ctx, task, metrics, source):
    return [m for m in metrics
            if done.get((pair.model_name, policy, budget, ctx, task, m, seed)) != source]

  def flush():
    write_json(out_path, records)
    write_json(outputs_path, list(outputs.values()))

  for ctx in [int(c) for c in FLAGS.contexts]:
    # ---- batches: long-text continuation (+ sparse ppl), then each task
    batches = []
    if FLAGS.n_prompts:
      full_prompts, offsets = continuation_prompts(pair.tokenizer, FLAGS.text, FLAGS.n_prompts,
                                                   ctx + FLAGS.ppl_tokens, seed)
      batches.append(dict(
          task=f"continuation:{FLAGS.text}", prompts=[p[:ctx] for p in full_prompts],
          refs=[p[ctx:] for p in full_prompts], items=None, max_new=FLAGS.max_new, eos=(),
          source=f"{FLAGS.text} char offsets {offsets}, {FLAGS.max_new} greedy tokens, "
                 f"no EOS stop; ppl over the next {FLAGS.ppl_tokens} real tokens"))
    for task in task_names:
      items = tasklib.build_task(task, pair.tokenizer, ctx, FLAGS.n_items, seed=seed)
      batches.append(dict(
          task=task, prompts=[list(it.prompt_ids) for it in items], refs=None, items=items,
          max_new=max(it.max_new_tokens for it in items), eos=eos,
          source=f"dustin_jax/eval/tasks.py {task} on {tasklib.DEFAULT_TEXT[task]}, "
                 f"{len(items)} items, seed {seed}, scorer {items[0].scorer}"))
    max_len = ctx + max(FLAGS.max_new, FLAGS.ppl_tokens, max(tasklib.MAX_NEW.values())) \
        + gamma + 2
    for batch in batches:
      task = batch["task"]
      gen_metrics = ["tau", "acceptance", "agreement", "arr"]
      gen_metrics += [] if batch["refs"] else ["accuracy"]
      tf_metrics = ["ppl", "tf_agreement"] if batch["refs"] else []
      metrics = gen_metrics + tf_metrics
      todo = [(p, b) for p, b in runs() if missing(p, b, ctx, task, metrics, batch["source"])]
      if not todo:
        continue
      base = prefill_base(pair, batch["prompts"], max_len, progress=FLAGS.progress,
                          cache_dir=kv_cache_dir())
      print(f"[{ctx}] {task}: prefill {len(batch['prompts'])} x {ctx} tokens "
            f"{base.prefill_s:.1f} s", flush=True)
      full_key = f"{pair.model_name}|full|0|{ctx}|{task}|{seed}"
      if ("full", 0) not in todo and (full_key not in outputs or (
          tf_metrics and "tf_top1" not in outputs[full_key])):
        todo.insert(0, ("full", 0))   # its tokens are the agreement references
      src = batch["source"]
      for policy_name, budget in todo:
        if base is None:   # reload the prefilled rows from the disk cache (seconds)
          base = prefill_base(pair, batch["prompts"], max_len, cache_dir=kv_cache_dir())
        policy = make_policy(policy_name, max(budget, 1) if policy_name != "full" else 512,
                             pair, srh)
        t1 = time.perf_counter()
        need = missing(policy_name, budget, ctx, task, metrics, src)
        key = f"{pair.model_name}|{policy_name}|{budget}|{ctx}|{task}|{seed}"
        put = lambda metric, value, n: (metric in need and add(
            policy_name, budget, ctx, task, metric, value, n, src))
        line = f"[{ctx}] {task:28s} {policy_name:14s} b={budget:5d}"
        if set(need) & set(gen_metrics) or key not in outputs:
          res = run_policy(pair, base, policy, gamma=gamma, max_new_tokens=batch["max_new"],
                           eos_ids=batch["eos"], measure_arr=policy_name != "full",
                           seed=seed, progress=FLAGS.progress)
          texts = [pair.tokenizer.decode(t) for t in res.tokens]
          outputs[key] = {**outputs.get(key, {}), "key": key, "tokens": res.tokens,
                          "texts": texts}
          ref = outputs.get(full_key, {}).get("tokens")
          s = res.stats
          put("tau", s.tau, s.seq_steps)
          put("acceptance", s.acceptance_rate, s.seq_steps * gamma)
          put("arr", 1.0 if policy_name == "full" else res.arr, res.arr_n or s.seq_steps)
          if ref is not None:
            m, n = agreement(res.tokens, ref)
            put("agreement", m / max(n, 1), n)
          line += f" tau={s.tau:.3f} arr={res.arr if res.arr is not None else 1.0:.3f}"
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
            m, n = agreement(top1, ref)
            put("tf_agreement", m / max(n, 1), n)
          line += f" ppl={ppl:.3f} ({time.perf_counter() - t2:.1f} s)"
        flush()
        if kv_cache_dir():  # hold only the run's copy, not the base too (host memory)
          base = None
        release_host_memory()
        print(f"{line} ({time.perf_counter() - t1:.1f} s)", flush=True)
      del base
  print(f"evaluation: {time.perf_counter() - t_start:.1f} s -> {out_path}", flush=True)
  if FLAGS.report:
    write_report(records, FLAGS.out_dir)


def write_report(records, out_dir):
  """README.md (tables) and longctx.png (tau and accuracy vs budget)."""
  lines = ["# Long-context evaluation", "",
           "Generated by `scripts/eval_longctx.py` from `longctx.json` (long-format "
           "records: model, policy, budget, context, task, metric, value, n, seed, source). "
           "Greedy speculative decoding, gamma = "
           f"{records[0]['gamma'] if records else '?'}; `full` = lossless verification "
           "(budget 0 = the whole cache). tau = accepted drafts + 1 per verify step; "
           "agreement = share of `full`'s generated tokens reproduced at the same position "
           "(a greedy divergence cascades); tf agreement = the same per position when both are "
           "teacher-forced on the real continuation; "
           "ARR = attention recovery rate of the verification sets actually used "
           "(dustin_jax/selection/arr.py); ppl = teacher-forced perplexity of the real continuation with every block "
           "of gamma+1 tokens verified against the policy's set; accuracy = task score "
           "(dustin_jax/eval/tasks.py), averaged over tasks.", ""]
  models = sorted({r["model"] for r in records})
  for model in models:
    for ctx in sorted({r["context"] for r in records if r["model"] == model}):
      rs = [r for r in records if r["model"] == model and r["context"] == ctx]
      task_cols = sorted({r["task"] for r in rs if not r["task"].startswith("continuation")})
      columns = ["policy", "budget", "seeds", *TABLE_METRICS.values(), *task_cols]
      lines += [f"## {model}, context {ctx}", "", "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns)]
      keys = sorted({(r["policy"], r["budget"]) for r in rs},
                    key=lambda k: (k[1], POLICY_ORDER.index(k[0]) if k[0] in POLICY_ORDER else 9))
      for pol, b in keys:
        cell = lambda metric, task=None: mean_value(
            [r for r in rs if r["policy"] == pol and r["budget"] == b and r["metric"] == metric
             and (task is None or r["task"] == task)], metric)
        fmt = lambda v, d=3: "" if v is None else f"{v:.{d}f}"
        seeds = ",".join(str(x) for x in sorted({r["seed"] for r in rs
                                                  if r["policy"] == pol and r["budget"] == b}))
        row = ([pol, str(b), seeds] + [fmt(cell(m)) for m in TABLE_METRICS]
               + [fmt(cell("accuracy", t), 2) for t in task_cols])
        lines.append("| " + " | ".join(row) + " |")
      lines.append("")
  lines += targets_section(records)
  lines += extra_sections(out_dir)
  with open(os.path.join(out_dir, "README.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  plot_report(records, os.path.join(out_dir, "longctx.png"))


def targets_section(records, budget: int = 512) -> list[str]:
  """The issue's acceptance targets, checked from the records (budget 512)."""
  lines = []
  val = lambda rs, metric, tasks=None: mean_value(
      [r for r in rs if r["metric"] == metric and (tasks is None or r["task"] in tasks)], metric)

  for model in sorted({r["model"] for r in records}):
    for ctx in sorted({r["context"] for r in records if r["model"] == model}):
      at = lambda pol, b: [r for r in records if r["model"] == model and r["context"] == ctx
                           and r["policy"] == pol and r["budget"] == b]
      full, dus = at("full", 0), at("dustin", budget)
      if not full or not dus:
        continue
      ok = lambda c: "holds" if c else "**does not hold**"
      t_f, t_d = val(full, "tau"), val(dus, "tau")
      cont = sorted({r["task"] for r in dus if r["task"].startswith("continuation")})
      acc_tasks = sorted({r["task"] for r in dus if r["metric"] == "accuracy"})
      lines += [f"## Targets at budget {budget}, context {ctx} ({model})", ""]
      if t_f and t_d:
        ratio = t_d / t_f
        extra = ""
        if cont and val(full, "tau", cont) and val(dus, "tau", cont):
          extra = f"; continuation only {val(dus, 'tau', cont) / val(full, 'tau', cont):.1%}"
        lines.append(f"* tau(dustin) / tau(full) = {t_d:.3f} / {t_f:.3f} = {ratio:.1%} over all "
                     f"batches{extra} (target >= 98%): {ok(ratio >= 0.98)}")
      ag, tf = val(dus, "agreement"), val(dus, "tf_agreement")
      if ag is not None:
        lines.append(f"* token agreement with full: {ag:.1%} generated (cascading)"
                     + (f", {tf:.1%} teacher-forced" if tf is not None else "")
                     + f" (target >= 95%): {ok(ag >= 0.95)}")
      if acc_tasks:
        a_f = val([r for r in full if r["task"] in acc_tasks], "accuracy")
        a_d = val([r for r in dus if r["task"] in acc_tasks], "accuracy")
        if a_f is not None and a_d is not None:
          lines.append(f"* task accuracy (mean over {len(acc_tasks)} tasks): dustin {100 * a_d:.1f} "
                       f"vs full {100 * a_f:.1f} points (target: within 0.5): "
                       f"{ok(abs(a_d - a_f) * 100 <= 0.5 or a_d >= a_f)}")
      arr = {p: val(at(p, budget), "arr") for p in ("dustin", "dustin_draft", "dustin_target",
                                                    "streaming", "quest", "oracle")}
      if all(arr[p] is not None for p in ("dustin", "dustin_draft", "dustin_target")):
        lines.append(f"* ARR hybrid {arr['dustin']:.3f} >= draft-only {arr['dustin_draft']:.3f} "
                     f">= target-only {arr['dustin_target']:.3f}: "
                     f"{ok(arr['dustin'] >= arr['dustin_draft'] >= arr['dustin_target'])}")
      for p, rel in (("streaming", ">"), ("quest", ">=")):
        if arr[p] is not None:
          c = arr["dustin"] > arr[p] if rel == ">" else arr["dustin"] >= arr[p]
          lines.append(f"* ARR hybrid {arr['dustin']:.3f} {rel} {p} {arr[p]:.3f}: {ok(c)}")
      if arr["oracle"] is not None:
        lines.append(f"* (Oracle ARR at this budget: {arr['oracle']:.3f}; tau(oracle)/tau(full) "
                     f"= {val(at('oracle', budget), 'tau') / t_f:.1%})")
      lines.append("")
  return lines


def extra_sections(out_dir) -> list[str]:
  """The tau table (tau.json), the shipped SRH profile and the method notes."""
  lines = []
  tau_path = os.path.join(out_dir, "tau.json")
  if os.path.isfile(tau_path):
    recs = load_records(tau_path)
    lines += ["## tau table (`tau.json`, for the GPU benchmark)", "",
              "| model | context | policy | budget | gamma | tau | acceptance | steps |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["context"], POLICY_ORDER.index(r["policy"])
                                         if r["policy"] in POLICY_ORDER else 9, r["gamma"])):
      lines.append(f"| {r['model']} | {r['context']} | {r['policy']} | {r['budget']} | "
                   f"{r['gamma']} | {r['tau']:.3f} | {r['acceptance']:.3f} | {r['n_steps']} |")
    if recs:
      lines += ["", f"Source: {recs[0]['source']}", ""]
  for path in sorted(glob.glob(os.path.join("configs", "srh", "*.json"))):
    with open(path) as f:
      srh = json.load(f)
    search = srh.get("search", {})
    cal = srh.get("calibration", {})
    lines += [f"## SRH profile `{path}`", "",
              f"Draft heads {srh['draft_heads']}, target heads {srh['target_heads']}, "
              f"m = {srh['m']}, n_sink = {srh['n_sink']}, n_window = {srh['n_window']}, "
              f"budget = {srh['budget']}: calibration ARR **{srh['arr']:.4f}** "
              f"(baselines: {', '.join(f'{k} {v:.4f}' for k, v in search.get('baselines', {}).items())}). "
              f"Calibration: {cal.get('n_items')} items of {cal.get('contexts')} tokens from "
              f"{cal.get('texts')} (seed {cal.get('seed')}), {cal.get('n_steps')} verify steps "
              f"of lossless greedy SD (gamma {cal.get('gamma')}). Runtime "
              f"{srh.get('runtime_s')} s. Plot: `srh_profile.png`.", ""]
  lines += ["## How the numbers are made", "",
            "* One prefill per batch of prompts (cached on disk); every policy starts from a "
            "copy of the caches. Decoding runs the step with ARR measured (`StepOptions(measure_arr=True)`): "
            "the policy's own sparse verification, plus a full-cache target pass that measures "
            "ARR (and in which the Oracle selects).",
            "* Sparse perplexity: the real continuation is scored teacher-forced in blocks of "
            "gamma+1 tokens; each block is verified exactly like a speculative step whose "
            "draft tokens are the real ones (the draft still runs over them, so Dustin gets its "
            "lookahead signal; the target verifies against the policy's I_verify; the next "
            "step's target-historical signal comes from that verify).",
            "* Tasks (dustin_jax/eval/tasks.py): passkey / needle / multi-key retrieval in KJV "
            "text, which-chapter QA over consecutive KJV chapters, next-line code completion "
            "on the Python standard library (edit similarity). Calibration for the SRH search "
            "used other texts or offsets (web-bible, python-stdlib at seed 1234).",
            "* Few items per task (CPU time): one changed answer moves a task's accuracy "
            "by 1/n; read the accuracy columns with that granularity in mind. `seeds`: the "
            "item sets a row averages (each seed draws its own prompts and task items); rows "
            "with more seeds average more items, so compare budgets on the rows of one seed.",
            ""]
  return lines


# the metrics of the README tables: record name -> column
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


if __name__ == "__main__":
  app.run(main)
