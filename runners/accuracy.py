"""How far a plan with bf16 regions strays from the model in f32.

A bf16 region trades accuracy for speed, and errors of regions that are each small can
add up through a model; only the whole plan's outputs tell. So a plan with bf16 regions
is run beside its f32 twin (the same regions, every one in f32) on two input sets: the
inputs the search measures with, and a second, seeded set that the search never uses,
drawn like them (so a plan cannot fit the one set it was chosen on). Its error is the
largest, over both sets and every output, of the norm-wise relative error
``||y - y_f32|| / ||y_f32||``: an elementwise ratio would blow up on outputs near zero.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from partune.core import Plan

HELD_OUT_SEED = 20261204  # the second input set: never the search's


def has_bf16(plan: Plan) -> bool:
    return any(r.scope.compute_precision == "bf16" for r in plan.regions)


def f32_twin(plan: Plan) -> Plan:
    """``plan`` with every region computing in f32 (the reference its error is measured against)."""
    return replace(
        plan,
        regions=tuple(replace(r, scope=replace(r.scope, precision=None)) for r in plan.regions),
    )


def held_out_inputs(inputs: Sequence[np.ndarray], seed: int = HELD_OUT_SEED) -> list[np.ndarray]:
    """A second input set drawn like ``inputs``: floats with each input's mean and spread,
    integers (token ids, indices) within each input's range, booleans at random."""
    rng = np.random.default_rng(seed)
    out = []
    for a in inputs:
        if a.dtype == bool:
            out.append(rng.integers(0, 2, size=a.shape).astype(bool))
        elif np.issubdtype(a.dtype, np.integer):
            lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
            out.append(rng.integers(lo, hi + 1, size=a.shape).astype(a.dtype))
        else:
            mean, std = (float(a.mean()), float(a.std())) if a.size else (0.0, 1.0)
            out.append((mean + (std or 1.0) * rng.standard_normal(a.shape)).astype(a.dtype))
    return out


def relative_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The largest norm-wise relative error of ``outputs`` against ``reference`` (inf on a
    NaN or a shape mismatch; the absolute error where the reference is all zeros)."""
    worst = 0.0
    for y, r in zip(outputs, reference, strict=True):
        if y.shape != r.shape:
            return float("inf")
        if not np.issubdtype(r.dtype, np.floating):
            worst = max(worst, float(np.mean(y != r)))  # integer outputs: the share that differ
            continue
        diff = np.linalg.norm((y.astype(np.float64) - r.astype(np.float64)).ravel())
        scale = np.linalg.norm(r.astype(np.float64).ravel())
        err = diff / scale if scale > 0 else diff
        worst = max(worst, float(err) if np.isfinite(err) else float("inf"))
    return worst


def plan_error(
    run: Callable[[list[np.ndarray]], list[np.ndarray]],
    reference: Callable[[list[np.ndarray]], list[np.ndarray]],
    inputs: list[np.ndarray],
) -> float:
    """``run``'s largest relative error against ``reference`` on ``inputs`` and on the held-out
    set."""
    return max(relative_error(run(x), reference(x)) for x in (inputs, held_out_inputs(inputs)))
