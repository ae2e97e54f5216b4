"""bf16 regions within the user's accuracy budget (``--precision bf16 --tolerance REL``).

Each bf16 region is measured like any candidate, and the DP takes it where it is faster.
But errors that are small per region add up through a model, so the budget is judged on
whole plans only: every plan with bf16 regions is measured end to end with its error
against its f32 twin (``partune.runners.accuracy``), and a plan over budget counts as
failed for everything that chooses (the DP's rounds, refinement, the finalists, the
emitted plan). When the DP's plan is over budget, ``repair`` hands its bf16 regions back
to f32, those that gained least first, until a plan is within budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from partune.runners import Measurement, has_bf16

if TYPE_CHECKING:
    from partune.core import Plan, Region
    from partune.search.session_view import SessionView

MAX_REPAIRS = 4  # plans measured while handing bf16 regions back, before all go back at once


def over_budget(m: Measurement, tolerance: float | None) -> bool:
    return (
        tolerance is not None and m.ok and m.rel_error is not None and not m.rel_error <= tolerance
    )


def budgeted(m: Measurement, tolerance: float | None) -> Measurement:
    """``m`` as the search sees it: a failure when its plan strays beyond ``tolerance``."""
    if not over_budget(m, tolerance):
        return m
    return replace(
        Measurement.failed(
            f"over the accuracy budget: relative error {m.rel_error:.2g} > {tolerance:.2g}"
        ),
        rel_error=m.rel_error,
    )


def overran(m: Measurement) -> bool:
    """Whether ``m`` (as ``budgeted`` gave it) failed for its error alone."""
    return not m.ok and m.rel_error is not None


def _in_f32(s: SessionView, region: Region) -> Region:
    f32 = replace(region, scope=replace(region.scope, precision=None))
    return replace(f32, cost_s=s.stored_cost(f32))


def gain_s(s: SessionView, region: Region) -> float:
    """What a bf16 region saves over the same region in f32 (0 when either was not measured)."""
    bf16, f32 = s.stored_cost(region), s.stored_cost(_in_f32(s, region))
    return f32 - bf16 if bf16 is not None and f32 is not None else 0.0


def repair(s: SessionView, plan: Plan, label: str) -> str | None:
    """Variants of an over-budget ``plan`` with bf16 regions handed back to f32, the least
    gainful first, each measured; the label of the first within budget (None if none)."""
    order = sorted(
        (i for i, r in enumerate(plan.regions) if r.scope.compute_precision == "bf16"),
        key=lambda i: gain_s(s, plan.regions[i]),
    )
    if not order:
        return None
    # Hand back one region at a time, then (if still over) every region at once.
    steps = [order[: k + 1] for k in range(min(MAX_REPAIRS, len(order) - 1))] + [order]
    for step, back in enumerate(steps, start=1):
        regions = tuple(_in_f32(s, r) if i in back else r for i, r in enumerate(plan.regions))
        variant = replace(
            plan, regions=regions, notes={**plan.notes, "kind": "collage dp, within budget"}
        )
        name = f"{label} (bf16 within budget {step})"
        if not s.offer(name, variant):
            continue
        m = s.end_to_end(name, variant)
        if m.ok or not has_bf16(variant):
            return name
    return None
