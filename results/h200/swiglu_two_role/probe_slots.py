"""Device probe: swiglu_mlp kernel variants (knob_gpu: out_slots / stages / store),
0.5B draft shapes, a chain of L layers' distinct weights. Writes $OUT/probe_mlp.json."""
import json, os, sys, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp, numpy as np
from scripts.benchmarking import DeviceTimer, device_events
import knob_gpu
from kernels.swiglu_mlp.reference import stream_layout, swiglu_mlp_reference
from kernels.swiglu_mlp.ops import swiglu_mlp

L = 12
out = []
for d, fdim in [(896, 4864), (1536, 8960)]:
  key = jax.random.key(0)
  ws = [stream_layout((jax.random.normal(jax.random.fold_in(key, i), (d, 2 * fdim)) / np.sqrt(d)).astype(jnp.bfloat16),
                      (jax.random.normal(jax.random.fold_in(key, 100 + i), (fdim, d)) / np.sqrt(fdim)).astype(jnp.bfloat16))
        for i in range(L)]
  for m in ((16, 1, 64) if d == 896 else (16,)):
    x = jax.random.normal(jax.random.key(m), (m, d)).astype(jnp.bfloat16)
    r = jax.random.normal(jax.random.key(m + 1), (m, d)).astype(jnp.bfloat16)
    m8 = -(-m // 8) * 8
    def knob(**kw):
      def fn(x, w, r):
        pad = ((0, m8 - m), (0, 0))
        return knob_gpu.swiglu_mlp_gpu(jnp.pad(x, pad), w, jnp.pad(r, pad), **kw)[:m]
      return fn
    variants = {"main": knob(), "out4_s6": knob(out_slots=4, stages=6), "out4_s5": knob(out_slots=4, stages=5),
                "out6_s4": knob(out_slots=6, stages=4), "main_s6": knob(stages=6), "store_last": knob(store="last")}
    want = swiglu_mlp_reference(x, ws[0], r)
    for name, fn in variants.items():
      try:
        got = jax.jit(fn)(x, ws[0], r)
        err = float(jnp.max(jnp.abs(got - want)))
        def f(ws, x, r, fn=fn):
          for w in ws:
            r = fn(x, w, r)
            x = r.astype(x.dtype)
          return r
        fs = jax.jit(f)
        jax.block_until_ready(fs(ws, x, r)); jax.block_until_ready(fs(ws, x, r))
        with DeviceTimer() as t:
          for i in range(7):
            with t.window(name):
              jax.block_until_ready(fs(ws, x, r))
        busy = statistics.median(t.ms(name)) * 1e3 / L
        kern = [e["dur"] for e in device_events(t._ev) if "mosaic" in e.get("name", "")]
        rec = dict(d=d, f=fdim, rows=m, variant=name, max_abs_err=err, busy_us_per_layer=busy,
                   kernel_us_median=statistics.median(kern) if kern else None, kernels=len(kern))
      except Exception as e:  # a variant that does not lower is a result too
        rec = dict(d=d, f=fdim, rows=m, variant=name, error=repr(e)[-3000:])
      print(json.dumps(rec), flush=True)
      out.append(rec)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_mlp.json"), "w"), indent=1)
