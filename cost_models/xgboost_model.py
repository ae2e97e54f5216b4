"""An XGBoost cost model: region features -> predicted seconds.

Objective: squared error on log(seconds). The DP adds predicted costs across frontiers,
so predictions must be costs on one scale, not per-frontier ranking scores (which
``rank:pairwise`` would give); in log space an error is relative, so a 10 us region and
a 10 ms region weigh alike and the order inside a frontier is what the fit protects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from partune.cost_models.base import CostModel
from partune.cost_models.features import FEATURE_VERSION, NAMES

PARAMS = {
    "max_depth": 6,
    "eta": 0.1,
    "subsample": 0.9,
    "colsample_bytree": 0.9,
    "min_child_weight": 2,
    "objective": "reg:squarederror",
    "nthread": 1,
    "seed": 0,
}
ROUNDS = 300


class XGBoostCostModel(CostModel):
    """Gradient-boosted trees on log seconds (see the module docstring for why)."""

    def __init__(self, booster=None, trained_on: int = 0) -> None:
        self.booster = booster
        self.trained_on = trained_on

    def fit(self, x: np.ndarray, seconds: np.ndarray, rounds: int = ROUNDS) -> XGBoostCostModel:
        import xgboost as xgb

        data = xgb.DMatrix(x, label=np.log(np.maximum(seconds, 1e-9)), feature_names=list(NAMES))
        self.booster = xgb.train(PARAMS, data, num_boost_round=rounds)
        self.trained_on = len(seconds)
        return self

    def update(self, x: np.ndarray, seconds: np.ndarray, rounds: int = 50) -> XGBoostCostModel:
        """A new model that keeps boosting on new measurements (XGBoost continues from this
        model's trees); this one is left as it is, so a search can refit from the same base
        each time it has measured more (and not stack trees on trees)."""
        import xgboost as xgb

        if self.booster is None:
            return XGBoostCostModel().fit(x, seconds)
        data = xgb.DMatrix(x, label=np.log(np.maximum(seconds, 1e-9)), feature_names=list(NAMES))
        booster = xgb.train(PARAMS, data, num_boost_round=rounds, xgb_model=self.booster)
        return XGBoostCostModel(booster, self.trained_on + len(seconds))

    def predict(self, x: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        if self.booster is None:
            raise RuntimeError("the cost model is not trained")
        return np.exp(self.booster.predict(xgb.DMatrix(x, feature_names=list(NAMES))))

    def save(self, path: str | Path) -> None:
        """The booster as XGBoost JSON, and beside it the feature version it expects."""
        path = Path(path)
        _write_whole(path, lambda aside: self.booster.save_model(str(aside)))
        _write_whole(
            path.with_suffix(".meta.json"), lambda aside: aside.write_text(json.dumps(self._meta()))
        )

    @classmethod
    def load(cls, path: str | Path) -> XGBoostCostModel:
        import xgboost as xgb

        path = Path(path)
        meta = json.loads(path.with_suffix(".meta.json").read_text())
        _check(meta, path.with_suffix(".meta.json"))
        booster = xgb.Booster()
        booster.load_model(str(path))
        return cls(booster, meta["trained_on"])

    def to_text(self) -> str:
        """The model as one JSON text (its description and the booster's XGBoost JSON), for a
        storage that keeps it (``partune.cost_models.storage_kept``)."""
        return json.dumps(
            {"meta": self._meta(), "booster": bytes(self.booster.save_raw("json")).decode()}
        )

    @classmethod
    def from_text(cls, text: str, where: str) -> XGBoostCostModel:
        import xgboost as xgb

        doc = json.loads(text)
        if not isinstance(doc, dict) or not {"meta", "booster"} <= doc.keys():
            raise ValueError(f"{where} holds no Partune cost model")
        _check(doc["meta"], where)
        booster = xgb.Booster()
        booster.load_model(bytearray(doc["booster"].encode()))
        return cls(booster, doc["meta"]["trained_on"])

    def _meta(self) -> dict:
        return {
            "feature_version": FEATURE_VERSION,
            "features": list(NAMES),
            "trained_on": self.trained_on,
        }


def _check(meta, where) -> None:
    """A description this Partune can use: its keys there, and features of this version."""
    if not isinstance(meta, dict) or not {"feature_version", "trained_on"} <= meta.keys():
        raise ValueError(f"{where} is not a Partune cost model's description")
    if meta["feature_version"] != FEATURE_VERSION:
        raise ValueError(
            f"{where} was trained on feature version {meta['feature_version']}, "
            f"this Partune computes version {FEATURE_VERSION}"
        )


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` a file aside, then rename it to ``path``: the workers of one search save at about
    the same time, and a reader must never meet half a file. (The aside name ends in ".json",
    which keeps XGBoost's format.)"""
    aside = path.with_name(f".{path.stem}.{os.getpid()}.json")
    write(aside)
    os.replace(aside, path)
