"""The cost model kept inside a shared measurement storage.

A search on SQLite keeps its cost model in a file beside the store. A shared (PostgreSQL)
storage has no "beside": its workers run on several machines, and each would train a model
of its own. So there the model is kept in the storage itself, as an attribute of a study of
its own; every worker reads it when it starts and the last to finish writes it back.
"""

from __future__ import annotations

import optuna

from partune.cost_models.xgboost_model import XGBoostCostModel

STUDY = "partune:cost-model"
ATTR = "xgboost"


class StorageKeptModel:
    """Where the default cost model of a shared storage lives (``load`` and ``save``)."""

    def __init__(self, storage: optuna.storages.BaseStorage, url: str) -> None:
        self.storage = storage
        self.url = url

    def __str__(self) -> str:
        return f"the cost model kept in {self.url}"

    def _study(self) -> optuna.Study:
        return optuna.create_study(study_name=STUDY, storage=self.storage, load_if_exists=True)

    def load(self) -> XGBoostCostModel | None:
        """The model, or None where none was kept yet (ValueError: one this Partune cannot use)."""
        text = self._study().user_attrs.get(ATTR)
        return None if text is None else XGBoostCostModel.from_text(text, str(self))

    def save(self, model: XGBoostCostModel) -> None:
        self._study().set_user_attr(ATTR, model.to_text())
