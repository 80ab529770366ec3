"""The package imports without side effects and exports the step."""

import subprocess
import sys


def test_import_has_no_side_effects():
  code = "import sys, dustin_jax, kernels; print('jax' in sys.modules, 'transformers' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False False"


def test_public_names_resolve():
  import dustin_jax
  from dustin_jax import SpecConfig, generate_speculative, spec_step
  assert callable(spec_step) and callable(generate_speculative)
  assert SpecConfig(gamma=2).gamma == 2
  for name in dustin_jax.__all__:
    assert getattr(dustin_jax, name) is not None
