"""Device probe (a record of the measurement, run from the repository root with the row-major kernel's gpu.py and reference.py copied to .probe_old/ as old_gpu.py and old_reference.py): the row-major swiglu_mlp kernel
(.probe_old) against the transposed one, 0.5B / 1B draft shapes, a chain of
L layers' distinct weights as in a draft pass. Prints and writes JSON."""
import json, os, sys, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".probe_old"))
import jax, jax.numpy as jnp, numpy as np
from scripts.benchmarking import DeviceTimer, load_trace_events, device_events
import old_gpu, old_reference
from kernels.swiglu_mlp import gpu as new_gpu, reference as new_ref
from kernels.swiglu_mlp.ops import swiglu_mlp

L = 12
out = []
def chain(kernel_fn, ws, x0, r0):
  def f(ws, x, r):
    for w in ws:
      r = kernel_fn(x, w, r)
      x = r.astype(x.dtype)
    return r
  return jax.jit(f)

for d, fdim in [(896, 4864), (1536, 8960)]:
  key = jax.random.key(0)
  gus = [(jax.random.normal(jax.random.fold_in(key, i), (d, 2 * fdim)) / np.sqrt(d)).astype(jnp.bfloat16) for i in range(L)]
  dns = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (fdim, d)) / np.sqrt(fdim)).astype(jnp.bfloat16) for i in range(L)]
  for m in (16, 1, 32, 64):
    x = jax.random.normal(jax.random.key(m), (m, d)).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.key(m + 1), (m, d)).astype(jnp.bfloat16)
    variants = {}
    ws_old = [old_reference.stream_layout(g, dn) for g, dn in zip(gus, dns)]
    ws_new = [new_ref.stream_layout(g, dn) for g, dn in zip(gus, dns)]
    m8 = -(-m // 8) * 8
    def old_fn(x, w, r, m=m, m8=m8):
      pad = ((0, m8 - m), (0, 0))
      return old_gpu.swiglu_mlp_gpu(jnp.pad(x, pad), w, jnp.pad(r, pad), stages=7)[:m]
    variants["old_s7"] = (old_fn, ws_old)
    for st in (4, 7, 10):
      if not new_gpu.smem_bytes(rows=new_gpu.padded_rows(m), itemsize=2, stages=st) <= new_gpu.SMEM_BYTES:
        continue
      variants[f"new_s{st}"] = (lambda x, w, r, st=st: swiglu_mlp(x, w, r, impl="gpu", stages=st), ws_new)
    # correctness of one layer
    for name, (fn, ws) in variants.items():
      want = (old_reference if name.startswith("old") else new_ref).swiglu_mlp_reference(x, ws[0], r)
      got = jax.jit(fn)(x, ws[0], r)
      err = float(jnp.max(jnp.abs(got - want)))
      fns = chain(fn, ws, x, r)
      jax.block_until_ready(fns(ws, x, r)); jax.block_until_ready(fns(ws, x, r))
      with DeviceTimer() as t:
        for i in range(5):
          with t.window(name):
            jax.block_until_ready(fns(ws, x, r))
        ev = None
      busy = statistics.median(t.ms(name)) * 1e3 / L
      ev = device_events(t._ev)
      kern = [e["dur"] for e in ev if "mosaic" in e.get("name", "")]
      kus = statistics.median(kern) if kern else None
      rec = dict(d=d, f=fdim, rows=m, variant=name, max_abs_err=err, busy_us_per_layer=busy,
                 kernel_us_median=kus, kernels=len(kern))
      print(json.dumps(rec), flush=True)
      out.append(rec)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_mlp.json"), "w"), indent=1)
