"""Border costs: what plans cost end to end beyond their regions' isolated costs.

A region measured alone does not pay for what its borders cost inside a plan (copies between
backends, a library's call overhead, a cache gone cold). Every plan measured end to end gives
one equation, its time less its regions' isolated costs, against the features of its regions;
the fitted ``BorderModel`` prices each candidate's borders, and the DP proposes again with
them, ``BORDER_ROUNDS`` times at most, each proposal measured end to end and its equation added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partune.core import plan_key
from partune.cost_models import Equation, fit, region_features

if TYPE_CHECKING:
    from partune.core import Plan
    from partune.runners import Measurement
    from partune.search.session_view import SessionView

BORDER_ROUNDS = 3  # DP proposals refined by learned border costs, each measured end to end


def equation(session: SessionView, plan: Plan, m: Measurement) -> Equation | None:
    """What ``plan`` cost end to end beyond its regions' isolated costs, by its borders."""
    costs = [session.stored_cost(r) for r in plan.regions]
    if not m.ok or any(c is None for c in costs):
        return None
    isolated = sum(
        c + session.adjust.get(r.scope, 0.0) for c, r in zip(costs, plan.regions, strict=True)
    )
    feats = sum(region_features(session.graph, r.nodes) for r in plan.regions)
    return Equation(feats, m.cost_s - isolated, m.cost_s)


def border_rounds(session: SessionView) -> None:
    """Border costs learned from the plans measured; the DP proposes again with them."""
    result = session.result
    equations = {
        label: e
        for label, p in result.plans.items()
        if (e := equation(session, p, result.end_to_end[label])) is not None
    }
    for k in range(BORDER_ROUNDS):
        result.border = fit(list(equations.values()))
        refined = session.dp(set(session.backends), result.border)
        if refined is None:
            break
        label = f"partune dp+borders{'' if k == 0 else f' {k + 1}'}"
        if not session.offer(label, refined[1]):
            result.dp_label, (result.cover, result.dp_plan) = (
                session.label_of[plan_key(refined[1])],
                refined,
            )
            break  # a plan measured already (its regions here carry the DP's costs)
        result.dp_label = label
        result.cover, result.dp_plan = refined
        if (e := equation(session, refined[1], session.end_to_end(label, refined[1]))) is not None:
            equations[label] = e
    if result.border.equations:  # second opinions with border costs too
        session.end_to_end_all(
            {
                label: result.plans[label]
                for label in session.second_opinions(result.border, "+borders")
            }
        )
    estimate_dp_plan(session, equations)


def estimate_dp_plan(session: SessionView, equations: dict[str, Equation]) -> None:
    """The DP's estimate of its plan, with borders fitted on the other plans only: a prediction."""
    result = session.result
    if result.dp_label is None or result.dp_plan is None:
        result.dp_label = None
        return
    held_out = fit([e for label, e in equations.items() if label != result.dp_label])
    isolated = sum(r.cost_s or 0.0 for r in result.dp_plan.regions)
    feats = sum(region_features(session.graph, r.nodes) for r in result.dp_plan.regions)
    result.dp_estimate_s = isolated + held_out.extra_s(feats)
