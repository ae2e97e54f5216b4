"""Layer 7 of 8, ``partune.search``: partition rules, candidates, the DP, auto-tuning,
refinement, the verdict, and the session that runs them in order.

Imports every layer below it (see docs/architecture.md).
"""
