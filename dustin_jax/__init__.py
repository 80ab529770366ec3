"""dustin_jax: long-context speculative decoding with draft-augmented sparse
verification (Dustin), in JAX and Pallas.

Importing the package has no side effects (not even importing jax); the
public names below load their module on first use:

  from dustin_jax import spec_step, SpecConfig, init_state, load_checkpoint, Model
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "dustin_jax.config",
    "KVCache": "dustin_jax.cache",
    "Model": "dustin_jax.decoding",
    "DecodeStats": "dustin_jax.decoding",
    "StepOutput": "dustin_jax.decoding",
    "decode_loop": "dustin_jax.loop",
    "prefill": "dustin_jax.prefill",
    "generate": "dustin_jax.vanilla",
    "bind_vanilla_step": "dustin_jax.vanilla",
    "SamplingConfig": "dustin_jax.sampling",
    "load_checkpoint": "dustin_jax.weights",
    "random_params": "dustin_jax.weights",
    "SpecConfig": "dustin_jax.speculative.step",
    "SpecState": "dustin_jax.speculative.step",
    "StepOptions": "dustin_jax.speculative.step",
    "spec_step": "dustin_jax.speculative.step",
    "spec_step_fn": "dustin_jax.speculative.step",
    "bind_spec_step": "dustin_jax.speculative.step",
    "init_state": "dustin_jax.speculative.engine",
    "generate_speculative": "dustin_jax.speculative.engine",
    "make_policy": "dustin_jax.selection.policies",
    "policy_from_config": "dustin_jax.selection.policies",
    "make_mesh": "dustin_jax.sharding",
    "memory_plan": "dustin_jax.sharding",
    "enable_persistent_cache": "dustin_jax.compilation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'dustin_jax' has no attribute {name!r}")
