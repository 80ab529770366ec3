"""Grid MLP kernel variants in one process (chain of layers, wall clock)."""
import functools, importlib.util, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, os.getcwd())
from kernels.swiglu_mlp.reference import stream_layout
from kernels.swiglu_mlp import gpu as pkg

def load(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod

mods = {"pkg": pkg, "rmw": load(".probe/rmw_gpu.py", "rmw_gpu"), "knob": load(".probe/knob_gpu.py", "knob_gpu")}
D, F, L = 896, 4864, 12
ws = []
for i in range(L):
  kg, kd = jax.random.split(jax.random.key(i))
  ws.append(stream_layout((jax.random.normal(kg, (D, 2 * F)) / 30).astype(jnp.bfloat16),
                          (jax.random.normal(kd, (F, D)) / 70).astype(jnp.bfloat16)))

def make(kind, mod, **kw):
  @jax.jit
  def chain(x, ws):
    r = x.astype(jnp.float32)
    for w in ws:
      xb = r.astype(jnp.bfloat16)
      if kind == "blocks":
        r = mod.swiglu_mlp_gpu(xb, w, r, **kw)
      else:
        r = mod.swiglu_mlp_grid_gpu(xb, w, r, programs=132, **kw)
      r = r * 0.5
    return r
  return chain

def timed(fn, *a, repeats=30):
  jax.block_until_ready(fn(*a)); jax.block_until_ready(fn(*a))
  best = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats): out = fn(*a)
    jax.block_until_ready(out); best.append((time.perf_counter() - t0) / repeats)
  return min(best) * 1e6 / L

out = {"device": jax.devices()[0].device_kind, "runs": []}
x = jax.random.normal(jax.random.key(9), (16, D)).astype(jnp.bfloat16)
ref = None
variants = os.environ.get("VARIANTS", "blocks:pkg,grid:pkg,grid:rmw,grid:knob").split(",")
for v in variants:
  kind, modname, *kn = v.split(":")
  kw = {}
  if kn: kw["stages"] = int(kn[0])
  try:
    fn = make(kind, mods[modname], **kw)
    us = timed(fn, x, ws)
    y = np.asarray(fn(x, ws))
    if ref is None: ref = y
    rec = dict(variant=v, env={k: os.environ.get(k) for k in ("GRID_NOWAIT", "GRID_NOH", "GRID_NOZERO")},
               us_per_layer=us, max_rel_diff_vs_first=float(np.abs(y - ref).max() / (np.abs(ref).max() + 1e-30)), finite=bool(np.isfinite(y).all()))
  except Exception as e:
    rec = dict(variant=v, error=str(e)[:1500])
  out["runs"].append(rec); print(json.dumps(rec)[:300], flush=True)
tag = os.environ.get("TAG", "probe")
json.dump(out, open(os.path.join(os.environ.get("OUTDIR", "."), f"{tag}.json"), "w"), indent=1)
