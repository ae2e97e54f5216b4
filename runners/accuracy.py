"""How far a plan with bf16 regions strays from the model in f32.

A bf16 region trades accuracy for speed, and errors of regions that are each small can
add up through a model; only the whole plan's outputs tell. So a plan with bf16 regions
is run beside its f32 twin (the same regions, every one in f32) on two input sets: the
inputs the search measures with, and a second, seeded set that the search never uses,
drawn like them (so a plan cannot fit the one set it was chosen on). Its error is the
largest, over both sets and every output, of the norm-wise relative error
``||y - y_f32|| / ||y_f32||``: an elementwise ratio would blow up on outputs near zero.

Users judge accuracy by other measures too, so ``METRICS`` names each one a tolerance can be
set in (smaller is better for all): ``rel`` (the norm-wise error), ``cosine`` (1 minus the
cosine similarity: blind to a scale change, as an embedding's user is) and ``top1`` (the share
of rows whose predicted class changed, as a classifier's user sees it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from partune.core import PartuneError, draw_like

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from partune.core import Plan

HELD_OUT_SEED = 20261204  # the second input set: never the search's


def has_reduced(plan: Plan) -> bool:
    """Whether ``plan`` has a region in a precision that trades accuracy (bf16, int8)."""
    return any(r.scope.compute_precision != "f32" for r in plan.regions)


def f32_twin(plan: Plan) -> Plan:
    """``plan`` with every region computing in f32 (the reference its error is measured against)."""
    return replace(
        plan,
        regions=tuple(replace(r, scope=replace(r.scope, precision=None)) for r in plan.regions),
    )


def held_out_inputs(inputs: Sequence[np.ndarray], seed: int = HELD_OUT_SEED) -> list[np.ndarray]:
    """A second input set drawn like ``inputs``: floats with each input's mean and spread,
    integers (token ids, indices) within each input's range, booleans at random."""
    return draw_like(inputs, seed)


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
    validation: tuple[list[list[np.ndarray]], str] | None = None,
) -> float:
    """``run``'s error against ``reference``: on ``validation`` (the user's samples and metric,
    ``metric_error``), else the largest relative error on ``inputs`` and on the held-out set."""
    if validation is not None:
        samples, metric = validation
        return metric_error(metric, [run(x) for x in samples], [reference(x) for x in samples])
    return max(relative_error(run(x), reference(x)) for x in (inputs, held_out_inputs(inputs)))


def _differ_share(y: np.ndarray, r: np.ndarray) -> float:
    """Integer and boolean outputs (ids, masks) have no norm: the share of elements that differ."""
    return float(np.mean(y != r)) if r.size else 0.0


def cosine_error(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The largest ``1 - cos(y, r)`` over the outputs of one sample, each flattened (inf on a NaN
    or a shape mismatch; 1 where one of the two is all zeros and the other is not)."""
    worst = 0.0
    for y, r in zip(outputs, reference, strict=True):
        if y.shape != r.shape:
            return float("inf")
        if not np.issubdtype(r.dtype, np.floating):
            worst = max(worst, _differ_share(y, r))
            continue
        a, b = y.astype(np.float64).ravel(), r.astype(np.float64).ravel()
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            return float("inf")
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na == 0 or nb == 0:
            err = 0.0 if na == nb else 1.0
        else:
            err = 1.0 - float(np.dot(a, b) / (na * nb))
        worst = max(worst, min(max(err, 0.0), 2.0))  # rounding may step just outside [0, 2]
    return worst


def _top1_counts(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> tuple[int, int]:
    """(rows whose argmax over the last axis differs, rows) of the first output; a row where
    ``outputs`` is not finite counts as differing. -1 rows on a shape mismatch."""
    y, r = outputs[0], reference[0]
    if y.shape != r.shape or y.ndim == 0:
        return 0, -1
    y, r = y.reshape(-1, y.shape[-1]), r.reshape(-1, r.shape[-1])
    differ = (np.argmax(y, axis=-1) != np.argmax(r, axis=-1)) | ~np.all(np.isfinite(y), axis=-1)
    return int(np.sum(differ)), len(differ)


def top1_disagreement(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The share of rows of the first output (all axes but the last) whose top-1 class differs
    from the reference's: 1 - top-1 agreement (inf on a shape mismatch)."""
    differ, rows = _top1_counts(outputs, reference)
    return float("inf") if rows < 0 else differ / rows if rows else 0.0


# What each metric's value is called where a person reads it.
ERROR_NAMES = {"rel": "relative error", "cosine": "cosine error", "top1": "top-1 disagreement"}
# Each ``(outputs, reference) -> float`` of one sample; smaller is better.
METRICS: dict[str, Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], float]] = {
    "rel": relative_error,
    "cosine": cosine_error,
    "top1": top1_disagreement,
}


def _unknown(metric: str) -> PartuneError:
    return PartuneError(f"unknown accuracy metric '{metric}' (choose {', '.join(METRICS)})")


def metric_error(
    metric: str,
    samples_outputs: Sequence[Sequence[np.ndarray]],
    samples_reference: Sequence[Sequence[np.ndarray]],
) -> float:
    """``metric`` over several samples: the worst sample for ``rel`` and ``cosine`` (a tolerance
    bounds every sample), the share of all rows of all samples for ``top1`` (an agreement rate
    is read over a data set, and one sample may hold a single row)."""
    if metric not in METRICS:
        raise _unknown(metric)
    pairs = list(zip(samples_outputs, samples_reference, strict=True))
    if metric != "top1":
        return max((METRICS[metric](y, r) for y, r in pairs), default=0.0)
    differ = rows = 0
    for y, r in pairs:
        d, n = _top1_counts(y, r)
        if n < 0:
            return float("inf")
        differ, rows = differ + d, rows + n
    return differ / rows if rows else 0.0


def check_metric_fits(metric: str, reference_outputs: Sequence[np.ndarray]) -> None:
    """Refuse, before any measuring, a metric that cannot judge these outputs: ``top1`` needs a
    floating-point first output with a class axis (its last) of more than one entry."""
    if metric not in METRICS:
        raise _unknown(metric)
    if metric != "top1":
        return
    if not reference_outputs:
        raise PartuneError("metric top1 needs a model output; this model has none")
    first = reference_outputs[0]
    if not np.issubdtype(first.dtype, np.floating):
        raise PartuneError(
            f"metric top1 needs scores in the model's first output, but it is {first.dtype} "
            "(use rel or cosine)"
        )
    if first.ndim == 0 or first.shape[-1] < 2:
        raise PartuneError(
            f"metric top1 needs a class axis (the last) in the model's first output, but its "
            f"shape is {tuple(first.shape)} (use rel or cosine)"
        )
