"""Results kept beside the measurements, in the same storage, that are not timings: what a
resumed search must not compute again (an int8 model's calibrated ranges). Each is a JSON value
under a key, an attribute of a study of its own, so every worker of a shared storage reads it.
"""

from __future__ import annotations

import json
from typing import Any

import optuna

STUDY = "partune:notes"


class Notes:
    """JSON values by key in ``storage`` (``get`` and ``put``)."""

    def __init__(self, storage: optuna.storages.BaseStorage) -> None:
        self.study = optuna.create_study(study_name=STUDY, storage=storage, load_if_exists=True)

    def get(self, key: str) -> Any | None:
        text = self.study.user_attrs.get(key)
        return None if text is None else json.loads(text)

    def put(self, key: str, value: Any) -> None:
        self.study.set_user_attr(key, json.dumps(value))
