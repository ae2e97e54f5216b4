"""Leave-one-model-out evaluation of the cost model on a measurement store.

The question a cost model must answer in the search is "which candidates of this DP
frontier are worth measuring": the DP extends the lowest uncovered node, so a frontier
is the set of candidates that start at one node. Per held-out model: train on every
other model's measurements (regions that also occur in the held-out model are left out
of training: same key, same cost, no leakage), predict, and score each frontier of two
or more measured candidates by Spearman rank correlation and by whether the truly
cheapest candidate is the predicted top 1 or among the predicted top 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from partune.cost_models import XGBoostCostModel, featurize


@dataclass
class Samples:
    """Measured candidates of one model: features, costs, frontier (first node), store keys."""

    model: str
    x: np.ndarray
    seconds: np.ndarray
    frontier: np.ndarray
    keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Score:
    model: str
    samples: int
    frontiers: int
    spearman: float
    top1: float
    top3: float


def samples_for(model, store, backends: list[str], threads: int = 1) -> Samples:
    """Every candidate of ``model`` whose measurement is in ``store`` (failed ones excluded)."""
    from partune.core import CompilationConfig, candidate_key
    from partune.search.candidates import enumerate_candidates
    from partune.search.dp import schedulable

    config = CompilationConfig.for_cpu(backends, threads)
    rows, costs, fronts, keys = [], [], [], []
    seen = set()
    for c in enumerate_candidates(model.mod, model.graph, config):
        key = candidate_key(model.graph, c.subgraph.nodes, c.scope)
        m = store.get(key)
        if not schedulable(c) or m is None or not m.ok or (key, c.subgraph.nodes[0]) in seen:
            continue
        seen.add((key, c.subgraph.nodes[0]))
        rows.append(featurize(model.graph, c.subgraph.nodes, c.backend))
        costs.append(m.cost_s)
        fronts.append(c.subgraph.nodes[0])
        keys.append(key)
    return Samples(model.name, np.array(rows), np.array(costs), np.array(fronts), keys)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho (average ranks for ties)."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties share their mean rank
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def score(model: str, predicted: np.ndarray, truth: np.ndarray, frontier: np.ndarray) -> Score:
    rhos, top1, top3 = [], [], []
    for f in np.unique(frontier):
        idx = np.flatnonzero(frontier == f)
        if len(idx) < 2:
            continue
        p, t = predicted[idx], truth[idx]
        rhos.append(rank_correlation(p, t))
        best = int(np.argmin(t))
        ranked = list(np.argsort(p, kind="stable"))
        top1.append(ranked[0] == best)
        top3.append(best in ranked[:3])
    return Score(model, len(truth), len(rhos), _mean(rhos), _mean(top1), _mean(top3))


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def leave_one_model_out(data: list[Samples]) -> list[Score]:
    scores = []
    for held in data:
        held_keys = set(held.keys)
        train = [
            (s.x[i], s.seconds[i])
            for s in data
            if s is not held
            for i, k in enumerate(s.keys)
            if k not in held_keys
        ]
        if not train or len(held.seconds) == 0:
            continue
        model = XGBoostCostModel().fit(
            np.array([x for x, _ in train]), np.array([y for _, y in train])
        )
        scores.append(score(held.model, model.predict(held.x), held.seconds, held.frontier))
    return scores
