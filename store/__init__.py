"""Layer 5 of 8, ``partune.store``: every measurement kept in Optuna storage under a
stable key, and the claims that keep workers sharing a storage from taking one twice.

Imports the layers below: core, backends, runners (see docs/architecture.md).
"""
