"""Partune: measure-driven partitioning of deep-learning models across backends.

Layer 8 of 8 is this package's own modules: the CLI and its commands, export and the
deploy loader, reports and benchmarks. The layers below live in the sub-packages core,
frontend, backends, runners, store, cost_models and search, each in its own top-level
folder of the repository (see docs/architecture.md).
"""

__version__ = "0.1.0"
