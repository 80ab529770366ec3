"""Pallas kernels of dustin_jax, each beside its pure-jnp reference.

Kept import-light on purpose: transformers probes a top-level package named
`kernels` (Hugging Face's), so importing this package must be cheap and must
not pull in jax. Import the submodules (`kernels.decode_attention.ops`, ...).
"""
