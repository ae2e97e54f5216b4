"""Layer 3 of 7, ``partune.runners``: build a plan or a region into something runnable,
and time it, in a local worker process or on an RPC server.

Imports ``partune.core`` and ``partune.backends`` (see docs/architecture.md).
"""
