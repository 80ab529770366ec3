"""scripts/eval_longctx.py and scripts/profile_srh.py end to end on tiny
random models with tiny contexts, and the teacher-forced sparse perplexity
against a plain forward pass."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import python_path, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_KEYS = {"model", "policy", "budget", "context", "task", "metric", "value", "n", "seed",
               "source"}
TAU_KEYS = {"policy", "gamma", "budget", "tau", "acceptance", "n_steps", "context", "source",
            "model"}


def run(module, *args, timeout=120):
  # one CPU device is enough (and compiles faster)
  env = dict(os.environ, PYTHONPATH=python_path(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
  p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout


def test_eval_longctx_tiny_writes_the_documented_schema(tmp_path):
  out = tmp_path / "eval"
  common = ["--pair=tiny", "--contexts=512", "--budgets=48", "--n_prompts=2", "--n_items=2",
            "--max_new=6", "--ppl_tokens=8", "--gamma=3", f"--out_dir={out}", "--noprogress",
            "--policies=full,dustin,oracle", "--tasks=passkey"]
  run("scripts.eval_longctx", *common)
  records = json.loads((out / "longctx.json").read_text())
  assert records and all(RECORD_KEYS <= set(r) for r in records)
  metrics = {r["metric"] for r in records}
  assert metrics == {"tau", "acceptance", "agreement", "arr", "ppl", "tf_agreement", "accuracy"}
  assert {r["policy"] for r in records} == {"full", "dustin", "oracle"}
  full = [r for r in records if r["policy"] == "full"]
  assert all(r["value"] == 1.0 for r in full
             if r["metric"] in ("agreement", "arr", "tf_agreement"))
  arr = {r["policy"]: r["value"] for r in records
         if r["metric"] == "arr" and r["task"].startswith("continuation")}
  assert arr["oracle"] >= arr["dustin"] - 1e-6
  assert (out / "README.md").read_text().count("| dustin |") >= 1
  assert (out / "longctx.png").stat().st_size > 0
  # resumable: a second run adds nothing
  run("scripts.eval_longctx", *common)
  assert len(json.loads((out / "longctx.json").read_text())) == len(records)
  # other items (a third prompt): the continuation records are measured again and
  # replaced, full first (the agreement reference covers all three prompts)
  run("scripts.eval_longctx", *[a for a in common if not a.startswith(("--n_prompts", "--tasks"))],
      "--n_prompts=3", "--tasks=")
  again = json.loads((out / "longctx.json").read_text())
  assert len(again) == len(records)
  cont = lambda rs: {(r["policy"], r["metric"]): r for r in rs if r["task"].startswith("cont")}
  old, new = cont(records), cont(again)
  assert old.keys() == new.keys() and all(new[k]["source"] != old[k]["source"] for k in new)
  assert new[("full", "agreement")]["n"] == 3 * 6 and new[("full", "agreement")]["value"] == 1.0
  assert new[("dustin", "agreement")]["n"] == 3 * 6


def test_eval_longctx_only_tau_schema(tmp_path):
  path = tmp_path / "tau.json"
  run("scripts.eval_longctx", "--pair=tiny", "--only_tau", "--contexts=128", "--budgets=32",
      "--gammas=3", "--n_prompts=2", "--max_new=6", f"--tau_out={path}", "--noprogress",
      "--policies=full,dustin,quest")
  records = json.loads(path.read_text())
  assert len(records) == 3
  assert all(TAU_KEYS <= set(r) for r in records)
  assert {r["budget"] for r in records if r["policy"] == "full"} == {0}
  assert all(1.0 <= r["tau"] <= r["gamma"] + 1 for r in records)
  assert {r["draft_kv"] for r in records} == {"full"}
  # the streaming draft cache the fast step runs: a record of its own beside the full one's
  streaming = ["scripts.eval_longctx", "--pair=tiny", "--only_tau", "--contexts=128",
               "--budgets=32", "--gammas=3", "--n_prompts=2", "--max_new=6", f"--tau_out={path}",
               "--noprogress", "--policies=dustin", "--draft_kv=streaming", "--draft_sink=4",
               "--draft_window=16"]
  run(*streaming)
  run(*streaming)  # resumable: nothing added
  again = json.loads(path.read_text())
  assert len(again) == 4 and again[:3] == records
  assert again[3]["draft_kv"] == "streaming" and again[3]["policy"] == "dustin"
  assert (again[3]["draft_sink"], again[3]["draft_window"]) == (4, 16)
  assert 1.0 <= again[3]["tau"] <= 4


def test_profile_srh_tiny_writes_a_loadable_srh_file(tmp_path):
  out = tmp_path / "srh.json"
  run("scripts.profile_srh", "--pair=tiny", "--texts=python-stdlib", "--contexts=96",
      "--n_items=2", "--max_new=6", "--budget=32", "--n_sink=2", "--n_window=8",
      "--head_budget=3", "--heads_per_layer=1", "--top_n=64", f"--out={out}",
      f"--plot={tmp_path / 'p.png'}", f"--cache_dir={tmp_path / 'calib'}", "--noprogress")
  from dustin_jax.selection.srh import load_srh
  srh = load_srh(str(out))
  assert 0 < len(srh.draft_heads) + len(srh.target_heads) <= 3
  assert srh.budget == 32 and 0 <= srh.arr <= 1
  cal = srh.extra["calibration"]
  assert cal["n_items"] == 2 and cal["n_steps"] > 0
  assert {"text", "char_offset", "context", "n_steps"} <= set(cal["items"][0])
  assert srh.extra["search"]["history"][0]["n_heads"] == 0
  assert (tmp_path / "p.png").stat().st_size > 0
  assert len(list((tmp_path / "calib").glob("*.npz"))) == 2


def test_sparse_ppl_of_full_and_of_a_covering_budget_equals_the_plain_forward():
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from dustin_jax.cache import KVCache
  from dustin_jax.profiling.runtime import load_pair, prefill_base, sparse_ppl
  from dustin_jax.selection.policies import make_policy
  from dustin_jax.selection.base import FullCache
  sys.path.insert(0, ROOT)
  pair = load_pair("tiny")
  rng = np.random.default_rng(0)
  ctx, gamma = 40, 3
  seqs = [rng.integers(3, 259, size=ctx + 8).tolist() for _ in range(2)]
  base = prefill_base(pair, [s[:ctx] for s in seqs], 64)
  refs = [s[ctx:] for s in seqs]
  ppl_full, n = sparse_ppl(pair, base, FullCache(), refs, gamma)
  assert n == 16
  model = nnx.merge(pair.target.graphdef, pair.target.state)
  hidden, _, _ = model(jnp.asarray(seqs), KVCache.init(pair.target.cfg, 2, 64))
  logp = jax.nn.log_softmax(model.logits(hidden), -1)
  nll = [-float(logp[b, ctx - 1 + j, seqs[b][ctx + j]]) for b in range(2) for j in range(8)]
  assert ppl_full == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-4)
  covering = make_policy("dustin", budget=64, n_sink=2, n_window=8, m=20,
                         draft_heads=[[1, 0]], target_heads=[[2, 1]])
  assert sparse_ppl(pair, base, covering, refs, gamma)[0] == pytest.approx(ppl_full, rel=1e-4)
  small = make_policy("streaming", budget=12, n_sink=2)
  assert sparse_ppl(pair, base, small, refs, gamma)[0] != pytest.approx(ppl_full, rel=1e-3)
