# the allocator XLA uses with the graph flags, and what a user sees on stderr
set -u
for alloc in unset vmm; do
  for frac in unset 0.5; do
    ( [ $alloc = unset ] && unset XLA_PYTHON_CLIENT_ALLOCATOR || export XLA_PYTHON_CLIENT_ALLOCATOR=$alloc
      [ $frac = unset ] && unset XLA_PYTHON_CLIENT_MEM_FRACTION || export XLA_PYTHON_CLIENT_MEM_FRACTION=$frac
      python3 - <<'PY' 2>&1 | grep -v "^I1\|^I0"
import os
os.environ["XLA_FLAGS"] = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
import jax, jax.numpy as jnp
d = jax.devices()[0]
x = jnp.ones(1 << 20).sum()
st = d.memory_stats()
print("allocator", os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"), "fraction", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
      "bytes_limit GiB", round(st.get("bytes_limit", 0) / 2**30, 2), "in use GiB", round(st.get("bytes_in_use", 0) / 2**30, 3), float(x))
PY
    )
  done
done
echo "--- CLI, the package's flags (append_xla_flags sets the allocator)"
python3 -m scripts.decode --config=configs/tiny.py --config.target.num_layers=99 > /tmp/o.txt 2> /tmp/e.txt; echo "rc $?"; cat /tmp/e.txt
python3 -m scripts.decode --config=configs/tiny.py > /tmp/o.txt 2> /tmp/e.txt; echo "rc $?"; grep -c . /tmp/e.txt; grep -v "^I1" /tmp/e.txt | head -5; tail -3 /tmp/o.txt
