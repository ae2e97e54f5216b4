"""Border costs learned from plans measured end to end."""

from __future__ import annotations

import numpy as np

from partune.core.graph import DataflowGraph
from partune.cost_models.borders import Equation, fit, region_features
from tests.graphs import Diamond


def test_fit_recovers_planted_border_costs():
    rng = np.random.default_rng(0)
    true = np.array([5e-6, 2e-10, 0.0])
    eqs = []
    for _ in range(8):
        f = np.array([rng.integers(1, 40), rng.integers(1e4, 1e7), 3e6], dtype=float)
        eqs.append(Equation(f, float(f @ true)))
    model = fit(eqs)
    assert np.allclose(model.coef[:2], true[:2], rtol=1e-3)
    assert model.coef[2] < 1e-15 and model.equations == 8


def test_fit_never_goes_negative_and_an_empty_fit_adds_nothing():
    # More regions, less unexplained time: least squares would charge regions negative time.
    eqs = [Equation(np.array([n, 1e5, 0.0]), 1e-4 - n * 1e-6) for n in (1, 5, 20)]
    model = fit(eqs)
    assert all(c >= 0 for c in model.coef)
    assert fit([]).extra_s(np.array([10.0, 1e6, 1e6])) == 0.0


def test_region_features_count_what_crosses_the_border():
    g = DataflowGraph.from_function(Diamond["main"])  # relu -> (exp, tanh) -> add, 4x4 float32
    one, border, weights = region_features(g, [1, 2])
    assert one == 1.0 and weights == 0.0
    assert border == 3 * 64  # relu's result read in, exp's and tanh's results read by add
    assert region_features(g, range(4))[1] == 64  # the whole graph: only its result leaves
