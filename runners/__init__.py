"""Layer 4 of 8, ``partune.runners``: build a plan or a region into something runnable,
and time it, in a local worker process or on an RPC server.

Imports ``partune.core``, ``partune.backends`` and ``partune.frontend`` (the zoo and
the ``.pt2`` reader, to rebuild a torch peer; see docs/architecture.md).
"""
