"""What a region costs inside a whole model beyond its isolated time, learned from plans.

A candidate is timed alone, called over and over: its inputs and weights sit in cache
and nothing runs before or after it. Inside the model, its inputs were just written by
another backend's region, its weights were evicted by the layers before, and every
region boundary is a hand-off. So the sum of isolated costs underestimates a plan, the
more so the more regions and bytes cross borders (mobilenet-v3-small: 1.34 ms
estimated, 1.63 ms measured for a 60-region plan).

Every plan measured end to end is one equation: measured minus the sum of its regions'
isolated costs equals the sum of their border costs. A ``BorderModel`` is fitted to
those equations by non-negative least squares over three features per region: one (a
hand-off), the bytes crossing its border (inputs read from other regions plus results
others read), and the weight bytes it reads. The DP then charges each candidate its
predicted border cost, and plans it proposes are measured and added as equations.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from partune.core import DataflowGraph, SubGraph


def region_features(graph: DataflowGraph, nodes: Iterable[int]) -> np.ndarray:
    """(1, bytes crossing the region's border, weight bytes it reads unless it is the whole
    model)."""
    sub = SubGraph.of(graph, nodes)
    border = sum(graph.nodes[p].out_bytes for p in (*sub.inputs, *sub.exits))
    # Timed alone in a loop, a region keeps its weights in cache; in the model the other
    # regions evict them. A region that is the whole model was timed as it runs: no term.
    weights = sum(graph.nodes[n].const_bytes for n in sub.nodes) if len(sub) < len(graph) else 0
    return np.array([1.0, float(border), float(weights)])


@dataclass(frozen=True)
class BorderModel:
    """Seconds per region, per border byte and per weight byte (all >= 0)."""

    coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
    equations: int = 0  # how many measured plans it was fitted on

    def extra_s(self, features: np.ndarray) -> float:
        return float(np.dot(self.coef, features))

    def describe(self) -> str:
        per_region, per_byte, per_weight = self.coef
        return (
            f"{per_region * 1e6:.1f} us per region + {per_byte * 1e9:.3f} ns per border byte "
            f"+ {per_weight * 1e9:.3f} ns per weight byte (fitted on {self.equations} plans)"
        )


@dataclass(frozen=True)
class Equation:
    """One plan measured end to end: its regions' summed features and unexplained time."""

    features: np.ndarray  # summed over the plan's regions
    residual_s: float  # measured minus the sum of isolated (calibrated) region costs
    measured_s: float = 1.0  # the plan's measured time: equations weigh by relative error


def fit(equations: Sequence[Equation]) -> BorderModel:
    """Non-negative weighted least squares over the three features (exhaustive over active sets).

    Features are scaled to unit size first so bytes and counts weigh alike; with fewer
    equations than features the model keeps to the subsets it can determine.
    """
    if not equations:
        return BorderModel()
    # Relative errors: a slow plan (tvm-only, 10x the others) must not outweigh the plans
    # the DP chooses between, so each equation is divided by its plan's measured time.
    w = np.array([1.0 / max(e.measured_s, 1e-9) for e in equations])
    a = np.array([e.features for e in equations], dtype=float) * w[:, None]
    b = np.array([e.residual_s for e in equations], dtype=float) * w
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)
    a_s = a / scale
    best, best_err = np.zeros(3), float(np.sum(b**2))
    for k in range(1, min(3, len(equations)) + 1):
        for cols in itertools.combinations(range(3), k):
            x, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            full = np.zeros(3)
            full[list(cols)] = x
            err = float(np.sum((a_s @ full - b) ** 2))
            if err < best_err - 1e-18:
                best, best_err = full, err
    coef = best / scale
    return BorderModel((float(coef[0]), float(coef[1]), float(coef[2])), len(equations))
