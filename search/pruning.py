"""With a cost model: which candidates are measured up front, and which wait for the DP.

Measuring every candidate is the search's largest cost; a cost model ranks them, and
only the most promising of each DP frontier (plus a random share it learns from) are
measured before the DP runs. The DP measures any predicted candidate it picks.
"""

from __future__ import annotations

import random

import numpy as np

from partune.core import DataflowGraph
from partune.search.candidates import Candidate

TOP_K = 1  # candidates measured per DP frontier, by predicted cost
EPSILON = 0.05  # ... plus this share of all the rest, drawn at random (the model learns from them)


def features(graph: DataflowGraph, cands: list[Candidate]) -> np.ndarray:
    """The cost model's input, one row per candidate."""
    from partune.cost_models import featurize

    rows: dict[
        tuple[int, str], np.ndarray
    ] = {}  # one row per node set and backend (scopes share it)
    for c in cands:
        if (c.subgraph.mask, c.backend) not in rows:
            rows[c.subgraph.mask, c.backend] = featurize(graph, c.subgraph.nodes, c.backend)
    return np.stack([rows[c.subgraph.mask, c.backend] for c in cands])


def prune(
    cands: list[Candidate], x: np.ndarray, todo: dict[str, Candidate], cost_model
) -> tuple[dict[Candidate, float], dict[str, Candidate]]:
    """Predicted costs of all candidates, and the part of ``todo`` measured up front.

    A DP frontier is the set of candidates starting at one node (the DP extends the lowest
    uncovered node). Per frontier the ``TOP_K`` cheapest by prediction are measured, and
    ``EPSILON`` of all the others, drawn at random (seeded) over the whole model, so the
    model learns this model's costs where it is unsure. Every frontier keeps at least one
    measured candidate. What else is measured, the DP asks for (``OPTIMISM`` in the session).
    """
    predicted = dict(zip(cands, (float(v) for v in cost_model.predict(x)), strict=True))
    fronts: dict[int, list[tuple[str, Candidate]]] = {}
    for key, c in todo.items():
        fronts.setdefault(c.subgraph.nodes[0], []).append((key, c))
    keep: dict[str, Candidate] = {}
    rest: list[tuple[str, Candidate]] = []
    for members in fronts.values():
        members.sort(key=lambda kc: predicted[kc[1]])
        keep.update(members[:TOP_K])
        rest += members[TOP_K:]
    keep.update(random.Random(0).sample(rest, k=int(np.ceil(EPSILON * len(rest)))))
    return predicted, {k: c for k, c in todo.items() if k in keep}
