"""Does a get_global semaphore start at zero at every call? Each call signals
it once and reads it back."""
import json, os
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def body(o_ref):
  sem = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))
  pl.semaphore_signal(sem.at[0], 1)
  o_ref[...] = jnp.full(o_ref.shape, pl.semaphore_read(sem.at[0]), jnp.int32)

f = jax.jit(lambda: plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.int32), grid=(1,), grid_names=("p",))())
vals = [int(f()[0]) for _ in range(4)]
rec = dict(jax=jax.__version__, reads=vals)
print(json.dumps(rec))
json.dump(rec, open(os.path.join(os.environ.get("OUT", "/tmp"), "zero_init.json"), "w"))
