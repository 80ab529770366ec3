"""What a VMM-allocator client says about memory, and how much it lets one allocate."""
import os, sys
if sys.argv[1] == "graph":
  os.environ["XLA_FLAGS"] = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "vmm"
import jax, jax.numpy as jnp
d = jax.devices()[0]
print("mode", sys.argv[1], "fraction", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
      "prealloc", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
print("memory_stats", d.memory_stats())
for m in getattr(d, "addressable_memories", lambda: [])():
  print("memory", m, getattr(m, "kind", None))
print([a for a in dir(d) if "mem" in a.lower()])
keep, gib = [], 0
try:
  while gib < 200:
    keep.append(jnp.ones((4 << 30) // 2, jnp.bfloat16)); keep[-1].block_until_ready(); gib += 4
except Exception as e:
  print("stopped:", type(e).__name__, str(e).splitlines()[0][:200])
print("allocated GiB", gib)
