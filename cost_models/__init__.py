"""Layer 6 of 8, ``partune.cost_models``: what a region will cost before it is measured
(``CostModel``, ``XGBoostCostModel``), and what it costs at its borders inside a model.

Imports the layers below: core, backends, runners, store (see docs/architecture.md).
"""
