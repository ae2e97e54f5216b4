"""The CostModel interface: region features in, predicted seconds out.

The search needs only this (``partune.search.pruning`` and the session's ``learn``):
predict, learn from new measurements, and persist. One concrete class per file;
``XGBoostCostModel`` is the one Partune ships.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np


class CostModel(ABC):
    """Predicts a candidate's cost (seconds) from ``partune.cost_models.features`` vectors."""

    trained_on: int = 0  # measurements it has learned from

    @abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted seconds, one per row of ``x``."""

    @abstractmethod
    def update(self, x: np.ndarray, seconds: np.ndarray) -> CostModel:
        """A model that has also learned ``seconds`` for ``x`` (this one is left as it was)."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write the model where ``load`` reads it."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path) -> CostModel:
        """The model ``save`` wrote; a clear error for a file of another feature version."""
