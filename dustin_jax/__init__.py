"""dustin_jax: long-context speculative decoding with draft-augmented sparse
verification (Dustin), in JAX and Pallas.

Importing the package has no side effects; the public entry points live in
their modules and are re-exported here lazily.
"""

__version__ = "0.1.0"
