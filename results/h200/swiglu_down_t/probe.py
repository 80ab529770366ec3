"""Device probe: swiglu_mlp (the package's kernel, whichever tree runs this)
at the 0.5B and 1B draft shapes, a chain of L layers' distinct weights under
the step's graph flags; kernel us is the median of the kernel's trace
events. Writes $OUT/$PROBE_JSON."""
import json
import os
import statistics

from dustin_jax.config import append_xla_flags

append_xla_flags("")  # the step's graph flags, before the backend starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels.swiglu_mlp.ops import swiglu_mlp  # noqa: E402
from kernels.swiglu_mlp.reference import stream_layout, swiglu_mlp_reference  # noqa: E402
from scripts.benchmarking import DeviceTimer, device_events  # noqa: E402

L = 12
out = []
for d, f in [(896, 4864), (2048, 8192)]:
  key = jax.random.key(d)
  ws = [stream_layout(
      (jax.random.normal(jax.random.fold_in(key, i), (d, 2 * f)) / np.sqrt(d)).astype(jnp.bfloat16),
      (jax.random.normal(jax.random.fold_in(key, 100 + i), (f, d)) / np.sqrt(f)).astype(jnp.bfloat16))
        for i in range(L)]
  for m in ((16, 64) if d == 896 else (16,)):
    x0 = jax.random.normal(jax.random.key(m), (m, d)).astype(jnp.bfloat16)
    r0 = jax.random.normal(jax.random.key(m + 1), (m, d)).astype(jnp.bfloat16)
    fn = lambda x, w, r: swiglu_mlp(x, w, r, impl="gpu")
    err = float(jnp.max(jnp.abs(jax.jit(fn)(x0, ws[0], r0) - swiglu_mlp_reference(x0, ws[0], r0))))

    def chain(ws, x, r):
      for w in ws:
        r = fn(x, w, r)
        x = r.astype(x.dtype)
      return r
    run = jax.jit(chain)
    jax.block_until_ready(run(ws, x0, r0))
    jax.block_until_ready(run(ws, x0, r0))
    with DeviceTimer() as t:
      for _ in range(9):
        with t.window("chain"):
          jax.block_until_ready(run(ws, x0, r0))
    kern = [e["dur"] for e in device_events(t._ev) if "mosaic" in e.get("name", "")]
    rec = dict(d=d, f=f, rows=m, max_abs_err=err,
               busy_us_per_layer=round(statistics.median(t.ms("chain")) * 1e3 / L, 2),
               kernel_us_median=round(statistics.median(kern), 2), kernels=len(kern))
    print(json.dumps(rec), flush=True)
    out.append(rec)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, records=out),
          open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe.json")),
               "w"), indent=1)
