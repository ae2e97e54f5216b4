"""Layer 2 of 8, ``partune.backends``: real libraries and compilers, one module a backend.

The search reaches them only through ``registry``. Imports ``partune.core`` only
(see docs/architecture.md).
"""
