"""The cost model kept in a file: beside an SQLite store (``--cost-model auto``), or one the user
names.

Same interface as ``partune.cost_models.storage_kept.StorageKeptModel``, so a search loads
and saves its cost model without asking where it lives.
"""

from __future__ import annotations

import os

from partune.cost_models.xgboost_model import XGBoostCostModel


class FileKeptModel:
    """A cost model at ``path`` (its description beside it, ``.meta.json``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __str__(self) -> str:
        return f"cost model {self.path}"

    def load(self) -> XGBoostCostModel | None:
        """The model, or None where the file does not exist yet (ValueError or OSError: one this
        Partune cannot use)."""
        return XGBoostCostModel.load(self.path) if os.path.exists(self.path) else None

    def save(self, model: XGBoostCostModel) -> None:
        model.save(self.path)
