"""Device probe: the verify's XLA projections at 80 rows (7B shapes), a chain
of L layers' distinct weights, each product's output the next one's input.
Variants of how the product is written; busy us per layer and the kernels."""
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
                           " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
import json, sys, statistics, collections
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from scripts.benchmarking import DeviceTimer, device_events

L, M, D, F, QKV = 8, 80, 3584, 18944, 4608
bf = jnp.bfloat16
key = jax.random.key(0)
def w(i, shape):
  return (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / np.sqrt(shape[0])).astype(bf)
out = []

def timeit(name, f, args, floor_bytes):
  fs = jax.jit(f)
  try:
    r = fs(*args); jax.block_until_ready(r); jax.block_until_ready(fs(*args))
    with DeviceTimer() as t:
      for _ in range(6):
        with t.window(name):
          jax.block_until_ready(fs(*args))
    busy = statistics.median(t.ms(name)) * 1e3 / L
    ev = device_events(t._ev)
    k = collections.defaultdict(list)
    for e in ev:
      k[e["name"][:60]].append(e.get("dur", 0))
    kern = {n: (len(v) / 6 / L, statistics.median(v)) for n, v in k.items()}
    rec = dict(variant=name, busy_us_per_layer=busy, floor_us=floor_bytes / 4.23e6,
               kernels={n: [round(c, 2), round(d, 2)] for n, (c, d) in kern.items() if c >= 0.5},
               checksum=float(jnp.sum(r.astype(jnp.float32))))
  except Exception as e:
    rec = dict(variant=name, error=repr(e)[:400])
  print(json.dumps(rec), flush=True)
  out.append(rec)

x0 = jax.random.normal(jax.random.key(1), (M, D), jnp.float32).astype(bf)

# o: [D, D]
wo = [w(10 + i, (D, D)) for i in range(L)]
wo_t = [a.T.copy() for a in wo]
def chain(fn, ws):
  def f(ws, x):
    for a in ws:
      x = fn(x, a)
    return x
  return f
def plain(x, a): return jnp.dot(x, a, preferred_element_type=bf)
def nt(x, a_t): return lax.dot_general(x, a_t, (((1,), (1,)), ((), ())), preferred_element_type=bf)
def splitk(s):
  def fn(x, a):
    k = x.shape[1]
    p = jnp.einsum("msk,skn->smn", x.reshape(M, s, k // s), a.reshape(s, k // s, -1),
                   preferred_element_type=jnp.float32)
    return p.sum(0).astype(bf)
  return fn
ob = D * D * 2
timeit("o_plain", chain(plain, wo), (wo, x0), ob)
timeit("o_nt", chain(nt, wo_t), (wo_t, x0), ob)
for s in (2, 4, 7):
  timeit(f"o_splitk{s}", chain(splitk(s), wo), (wo, x0), ob)

# q/k/v with bias (the Linear's f32 path), output's first D columns feed the next
wq = [w(30 + i, (D, QKV)) for i in range(L)]
bq = [jnp.zeros((QKV,), bf) + 0.01 for _ in range(L)]
def qkv_plain(x, ab):
  a, b = ab
  y = jnp.dot(x, a, preferred_element_type=jnp.float32)
  return (y + b.astype(jnp.float32)).astype(bf)[:, :D]
def qkv_split(s):
  def fn(x, ab):
    a, b = ab
    return (splitk(s)(x, a).astype(jnp.float32) + b.astype(jnp.float32)).astype(bf)[:, :D]
  return fn
def qkv_bf16(x, ab):  # the product rounded to bf16, then the bias
  a, b = ab
  return (jnp.dot(x, a, preferred_element_type=bf) + b)[:, :D]
qb = D * QKV * 2
timeit("qkv_plain", chain(qkv_plain, list(zip(wq, bq))), (list(zip(wq, bq)), x0), qb)
timeit("qkv_bf16", chain(qkv_bf16, list(zip(wq, bq))), (list(zip(wq, bq)), x0), qb)
for s in (2, 4):
  timeit(f"qkv_splitk{s}", chain(qkv_split(s), list(zip(wq, bq))), (list(zip(wq, bq)), x0), qb)

# MLP with residual: gate/up [D, 2F] (pairs), down [F, D]
wgu = [w(50 + i, (D, 2 * F)) for i in range(L)]
wd = [w(70 + i, (F, D)) for i in range(L)]
def mlp(barrier):
  def fn(x, ab):
    a, b = ab
    gu = jnp.dot(x, a, preferred_element_type=bf).reshape(M, F, 2)
    h = jax.nn.silu(gu[..., 0]) * gu[..., 1]
    if barrier:
      h = lax.optimization_barrier(h)
    return x + jnp.dot(h, b, preferred_element_type=bf)
  return fn
mb = 3 * D * F * 2
ws = list(zip(wgu, wd))
timeit("mlp_plain", chain(mlp(False), ws), (ws, x0), mb)
timeit("mlp_barrier", chain(mlp(True), ws), (ws, x0), mb)
del wgu
wdo = wd
timeit("down_plain", chain(lambda x, a: x[:, :D] + jnp.dot(jnp.tile(x, (1, 6))[:, :F], a, preferred_element_type=bf), wdo), (wdo, x0), F * D * 2)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_verify.json"), "w"), indent=1)
