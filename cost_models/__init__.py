"""Layer 6 of 8, ``partune.cost_models``: what a region will cost before it is measured
(``CostModel``, ``XGBoostCostModel``), and what it costs at its borders inside a model.

Imports the layers below: core, backends, runners, store (see docs/architecture.md).
"""

from partune.core.exports import lazy_exports

__all__ = [
    "BorderModel",
    "CostModel",
    "Equation",
    "FileKeptModel",
    "StorageKeptModel",
    "XGBoostCostModel",
    "featurize",
    "fit",
    "region_features",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "base": ("CostModel",),
        "borders": (
            "BorderModel",
            "Equation",
            "fit",
            "region_features",
        ),
        "features": ("featurize",),
        "file_kept": ("FileKeptModel",),
        "storage_kept": ("StorageKeptModel",),
        "xgboost_model": ("XGBoostCostModel",),
    },
)
