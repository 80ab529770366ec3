"""Probe (not part of the package): do the verify's and the draft's
weight-streaming kernels run faster with their weights in L2, and does a
prefetch kernel running beside a latency-bound chain put them there in time?

Each case is one jit: a 256 MB multiply (evicts L2), then a chain of 8
dependent 64 x 64 dots (~14 us, a stand-in for the attention between two
projections), then the op that reads the weight w. Variants:
  twice             the op twice in a row (the second finds w in L2);
  chain8_pf0        chain, then the op (w from HBM);
  chain8_pf<P>      beside the chain a Mosaic GPU kernel of P programs sends
                    w to L2 (TMA prefetches, `_prefetch_to_l2`); the op
                    waits for that kernel;
  chain8_pf<P>_nowait  the same, the op does not wait for it.
Kernel start / duration (us, medians of 5 runs) go to <out>/l2_probe.json.

  python results/h200/l2_concurrent/probe.py <out dir>   # on the GPU
  python results/h200/l2_concurrent/probe.py --plot      # probe.json -> probe.png
"""
import json, os, sys, statistics
from dustin_jax.config import append_xla_flags
append_xla_flags("")
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels.swiglu_mlp.gpu import _prefetch_to_l2
from kernels.swiglu_mlp.ops import swiglu_mlp
from kernels.swiglu_mlp.reference import stream_layout
from scripts.benchmarking import load_trace_events, device_events
import tempfile

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/res"


def l2_prefetch(token, arrays, programs):
  """Sends `arrays` to L2 (TMA prefetches spread over `programs`); returns
  zeros [8, 128] f32 that depend on the kernel (and the kernel on token)."""
  arrays = tuple(a.reshape(-1, 128) for a in arrays)
  def body(tok_ref, *refs):
    *arr, out_ref = refs
    p = lax.axis_index("p")
    _prefetch_to_l2(arr, p, programs)
    def store(smem):
      @pl.when(p == 0)
      def _():
        smem[...] = jnp.zeros(smem.shape, smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_ref)
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(store, plgpu.SMEM((8, 128), jnp.float32), collective_axes="wg")
  return pl.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   mesh=plgpu.Mesh(grid=(programs,), grid_names=("p",), num_threads=1,
                                   thread_name="wg"),
                   compiler_params=plgpu.CompilerParams(
                       lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(token, *arrays)


def chain(v, s, n):
  for _ in range(n):
    v = jnp.tanh(v @ s)
  return v


def make(op, n_chain, prefetch_programs, wait=True):
  """flush L2 -> [chain of n small dots | concurrently: prefetch(w)] -> op(x, w)."""
  def f(big, v, s, x, w, extra):
    big2, v1 = lax.optimization_barrier((big * 3, v))
    tok = None
    if prefetch_programs:
      tok = l2_prefetch(v1[:8, :128], (w,), prefetch_programs)
    v2 = chain(v1, s, n_chain) if n_chain else v1
    dep = v2[0, 0]
    if tok is not None and wait:
      dep = dep + tok[0, 0]
    x1 = x + (dep * 0).astype(x.dtype)
    y = op(x1, w, extra)
    if tok is not None and not wait:
      y = y + (tok[0, 0] * 0).astype(y.dtype)
    return big2, y
  return jax.jit(f)


def twice(op):
  """flush -> op -> op (the second with w in L2 if it fits)."""
  def f(big, v, s, x, w, extra):
    big2, x1 = lax.optimization_barrier((big * 3, x))
    y1 = op(x1, w, extra)
    x2 = x + (y1[0, 0] * 0).astype(x.dtype)
    return big2, y1, op(x2, w, extra)
  return jax.jit(f)


def gemm(x, w, extra):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def mlp(x, w, extra):
  return swiglu_mlp(x, w, extra)


def profile(fns, args, reps=6):
  d = tempfile.mkdtemp()
  for name, fn in fns.items():
    jax.block_until_ready(fn(*args[name]))
  jax.profiler.start_trace(d, create_perfetto_trace=True)
  for name, fn in fns.items():
    for r in range(reps):
      with jax.profiler.TraceAnnotation(f"{name}#{r}"):
        jax.block_until_ready(fn(*args[name]))
  jax.profiler.stop_trace()
  ev = load_trace_events(d)
  dev = sorted(device_events(ev), key=lambda e: e["ts"])
  host = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in ev if e.get("ph") == "X" and "#" in e.get("name", "")}
  res = {}
  for name in fns:
    runs = []
    for r in range(1, reps):  # first run of each is dropped
      t0, t1 = host[f"{name}#{r}"]
      ks = [(e["name"][:60], e["ts"], e.get("dur", 0)) for e in dev if t0 <= e["ts"] <= t1]
      runs.append(ks)
    n = min(len(k) for k in runs)
    base = [k[0][1] for k in runs]
    rows = []
    for i in range(n):
      rows.append({"kernel": runs[0][i][0],
                   "start_us": statistics.median(k[i][1] - b for k, b in zip(runs, base)),
                   "dur_us": statistics.median(k[i][2] for k in runs)})
    res[name] = rows
  return res


def main():
  key = jax.random.key(0)
  big = jnp.ones((64, 2 * 1024 * 1024), jnp.bfloat16)  # 256 MB
  v = jnp.ones((64, 64), jnp.float32) * 0.01
  s = jax.random.normal(key, (64, 64), jnp.float32) * 0.1
  cases = {}
  x80 = jax.random.normal(key, (80, 3584), jnp.bfloat16)
  for name, n in (("o", 3584), ("qkv", 4608)):
    w = jax.random.normal(key, (3584, n), jnp.bfloat16) * 0.02
    cases[name] = (gemm, (big, v, s, x80, w, None))
  x16 = jax.random.normal(key, (16, 896), jnp.bfloat16)
  gu = jax.random.normal(key, (896, 2 * 4864), jnp.bfloat16) * 0.02
  dn = jax.random.normal(key, (4864, 896), jnp.bfloat16) * 0.02
  cases["draft_mlp"] = (mlp, (big, v, s, x16, stream_layout(gu, dn), x16))
  x16d = jax.random.normal(key, (16, 896), jnp.bfloat16)
  cases["draft_qkv"] = (gemm, (big, v, s, x16d, jax.random.normal(key, (896, 1152), jnp.bfloat16), None))
  out = {}
  for name, (op, args) in cases.items():
    fns, fargs = {}, {}
    fns["twice"] = twice(op); fargs["twice"] = args
    for n_chain in (0, 8):
      for p in (0, 66, 132):
        if n_chain == 0 and p:
          continue
        k = f"chain{n_chain}_pf{p}"
        fns[k] = make(op, n_chain, p); fargs[k] = args
        if p:
          fns[k + "_nowait"] = make(op, n_chain, p, wait=False); fargs[k + "_nowait"] = args
    try:
      out[name] = profile(fns, fargs)
    except Exception as e:  # keep going
      out[name] = {"error": repr(e)[:2000]}
    print("==", name)
    for k, rows in out[name].items():
      if isinstance(rows, str):
        print(k, rows); continue
      print(" ", k, " | ".join(f"{r['kernel'][:28]} {r['start_us']:.1f}+{r['dur_us']:.2f}" for r in rows if r['dur_us'] > 0.0))
    sys.stdout.flush()
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "l2_probe.json"), "w") as f:
    json.dump(out, f, indent=1)


def end_times(rows, case):
  """(us from the chain's first kernel to the op's end, the op's duration)."""
  chain = [r for r in rows if r["kernel"].startswith("gemm_fusion_dot_general")]
  mosaic = [r for r in rows if r["kernel"].startswith("body_mosaic")]
  if case == "draft_mlp":
    op = mosaic[-1]
  else:
    op = [r for r in rows if not r["kernel"].startswith(("gemm_fusion_dot_general", "body_mosaic",
                                                         "loop_", "memcpy", "Memcpy"))][-1]
  return op["start_us"] + op["dur_us"] - chain[0]["start_us"], op["dur_us"]


def plot(path_json, path_png):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(path_json) as f:
    res = json.load(f)
  variants = ("chain8_pf0", "chain8_pf132", "chain8_pf132_nowait", "chain8_pf66_nowait")
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for i, v in enumerate(variants):
    ends = [end_times(res[c][v], c) for c in res]
    xs = [j + i * 0.2 for j in range(len(res))]
    axes[0].bar(xs, [e for e, _ in ends], 0.2, label=v)
    axes[1].bar(xs, [d for _, d in ends], 0.2, label=v)
  for ax, title in zip(axes, ("chain start to the op's end (us)", "the op alone (us)")):
    ax.set_xticks([j + 0.3 for j in range(len(res))], list(res))
    ax.set_title(title)
  axes[1].legend(fontsize=7)
  fig.suptitle("L2 prefetch beside a latency-bound chain (H200)")
  fig.tight_layout()
  fig.savefig(path_png, dpi=110)


if __name__ == "__main__":
  if sys.argv[1:] == ["--plot"]:
    here = os.path.dirname(os.path.abspath(__file__))
    plot(os.path.join(here, "probe.json"), os.path.join(here, "probe.png"))
  else:
    main()
