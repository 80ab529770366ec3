"""Device probe: `streamk_matmul` against XLA's GEMM + add at the 7B's
projections (verify rows 80, plain-decoding rows 16), a chain of L layers'
distinct weights, each layer's x made from the previous layer's output so the
products run one after another. Writes $OUT/probe.json."""
import json
import os
import statistics

from dustin_jax.config import append_xla_flags

append_xla_flags("")  # the step's graph flags, before the backend starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels.streamk_matmul.gpu import streamk_matmul_t_gpu  # noqa: E402
from kernels.streamk_matmul.ops import streamk_matmul  # noqa: E402
from kernels.streamk_matmul.reference import streamk_matmul_reference  # noqa: E402
from scripts.benchmarking import DeviceTimer, device_events  # noqa: E402

L = 8
COPY_TBPS = 4.23
out = []
for name, k, n in [("down", 18944, 3584), ("qkv", 3584, 4608), ("o", 3584, 3584)]:
  key = jax.random.key(k + n)
  ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
        for i in range(L)]
  ws_t = [w.T.copy() for w in ws] if os.environ.get("PROBE_TRANSPOSED") else ws
  for m in (80, 16):
    x0 = jax.random.normal(jax.random.key(m), (m, k)).astype(jnp.bfloat16)
    r0 = jax.random.normal(jax.random.key(m + 1), (m, n)).astype(jnp.bfloat16)
    variants = {"xla": lambda x, w, r: r + jnp.dot(x, w, preferred_element_type=x.dtype)}
    tunings = [(132, 3, 2), (132, 4, 2), (128, 3, 2), (128, 4, 2)] if m > 64 else [
        (132, 4, 2), (132, 6, 2), (128, 4, 2), (128, 6, 2)]
    if os.environ.get("PROBE_TUNINGS"):  # programs:stages:out_slots,...
      tunings = [tuple(map(int, t.split(":"))) for t in os.environ["PROBE_TUNINGS"].split(",")]
      tunings = [t for t in tunings if (m > 64) == (t[1] <= 5)]
    for programs, stages, slots in tunings:
      variants[f"streamk_p{programs}_s{stages}_o{slots}"] = (
          lambda x, w, r, programs=programs, stages=stages, slots=slots: streamk_matmul(
              x, w, r, impl="gpu", programs=programs, stages=stages,
              out_slots=slots).astype(r.dtype))
    if os.environ.get("PROBE_TRANSPOSED"):  # stages: the transposed form's, per row count
      variants = {"xla": variants["xla"]}
      for stages in ((3, 4) if m > 64 else (4, 6)):
        variants[f"transposed_s{stages}"] = (
            lambda x, w, r, stages=stages: streamk_matmul_t_gpu(
                x, w, r.T, programs=132, stages=stages).T.astype(r.dtype))
    want = streamk_matmul_reference(x0, ws[0], r0)
    for vname, fn in variants.items():
      rec = dict(product=name, k=k, n=n, rows=m, variant=vname)
      try:
        wl = ws_t if vname.startswith("transposed") else ws
        err = float(jnp.max(jnp.abs(jax.jit(fn)(x0, wl[0], r0).astype(jnp.float32) - want)))

        def chain(ws, x, r, fn=fn):
          for w in ws:
            r = fn(x, w, r)
            x = x + r[:, :1]  # the next layer's input depends on this output
          return r
        run = jax.jit(chain)
        jax.block_until_ready(run(wl, x0, r0))
        jax.block_until_ready(run(wl, x0, r0))
        with DeviceTimer() as t:
          for _ in range(7):
            with t.window(vname):
              jax.block_until_ready(run(wl, x0, r0))
        busy = statistics.median(t.ms(vname)) * 1e3 / L
        kernels = {}
        for e in device_events(t._ev):
          kernels.setdefault(e.get("name", "?"), []).append(e["dur"])
        top = sorted(((statistics.median(v), len(v) // 7, kname) for kname, v in kernels.items()
                      if len(v) >= 7), reverse=True)[:4]
        rec.update(max_abs_err=err, busy_us_per_layer=round(busy, 2),
                   weight_floor_us=round(k * n * 2 / COPY_TBPS / 1e6, 2),
                   kernels=[dict(name=kn[:60], median_us=round(us, 2), per_chain=c)
                            for us, c, kn in top])
      except Exception as e:  # a variant that does not lower is a result too
        rec.update(error=repr(e)[:400])
      print(json.dumps(rec), flush=True)
      out.append(rec)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, records=out),
          open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe.json")), "w"), indent=1)
