"""Refinement and the finalists: the two phases of a search between the DP and the verdict.

``refinement`` has Optuna propose plan variants around the DP's plan and measures them end to
end (``partune.search.refine``); ``pick_finalists`` picks the plans that meet the peers in the
verdict (``partune.search.verdict``). Phases of ``SearchSession``, typed by ``SessionView``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from partune.backends import registry
from partune.core import REDUCED, PartuneError, clean_error, plan_key
from partune.runners import has_reduced
from partune.search.budget import PATIENCE, TRIALS_CAP
from partune.search.candidates import accepted_nodes
from partune.search.refine import refine, search_space

if TYPE_CHECKING:
    from partune.core import Plan
    from partune.runners import Measurement
    from partune.search.session_view import SessionView


def refinement(session: SessionView) -> None:
    """Plan variants around the DP's plan, proposed by Optuna and measured end to end."""
    from partune.search.candidates import precision_nodes
    from partune.search.verdict import refine_study_name

    opts, result = session.options, session.result
    trials, patience = (
        (opts.refine_trials, None) if opts.refine_trials is not None else (TRIALS_CAP, PATIENCE)
    )
    if trials <= 0 or result.dp_plan is None:
        return
    session.progress.start_phase(
        "refine plans end to end (Optuna"
        + (", NSGA-II" if opts.memory else "")
        + (", until it converges)" if patience else ")"),
        trials if not patience else 0,
    )
    accepted = {
        b: accepted_nodes(session.mod["main"], b)
        for b in session.backends
        if b not in session.autotuned
    }
    space = search_space(
        result.dp_plan,
        session.config,
        accepted,
        precision_nodes(session.mod["main"], session.config),
    )
    result.refine_study = refine_study_name(session.graph, result.dp_plan, opts.memory, space)

    # A variant whose measured regions alone are hopeless: not timed.
    def measure(p: Plan) -> Measurement:
        known = sum(c for r in p.regions if (c := session.stored_cost(r)) is not None)
        return session.hopeless(known) or session.measure(p, "refine variant", fresh=opts.memory)

    refined = refine(
        session.graph,
        result.dp_plan,
        session.config,
        accepted,
        measure,
        session.store.storage,
        result.refine_study,
        trials,
        deadline=opts.deadline,
        memory=opts.memory,
        claims=session.store.claims,
        patience=patience,
        space=space,
    )
    result.refined = refined
    if refined is not None:
        result.front = refined.front
        if session.offer("partune refined", refined.plan):
            result.end_to_end["partune refined"] = refined.measurement


def pick_finalists(session: SessionView) -> dict[str, Plan]:
    """The plans that meet the peers: the fastest few, plus each graph-level backend's own plan.

    The mirrors (onnxruntime-only vs onnxruntime on the user's file) are always in, so a
    noisy end-to-end sample can never keep the plan that ties the peer out of the verdict.
    """
    from partune.search.verdict import FINALISTS

    previous, result = session.options.previous, session.result
    # A model-file plan is not rebuilt here: its library meets the plans as a peer again.
    if (
        previous is not None
        and previous.fingerprint == session.graph.fingerprint
        and previous.model_file is None
    ):
        if session.offer("previous best", previous):  # a resumed job never emits worse than before
            session.end_to_end("previous best", previous)
    ok = {label: m for label, m in result.end_to_end.items() if m.ok}
    if not ok:
        # The model, as offered, runs nowhere: the user's to change (one line, exit 2).
        raise PartuneError(
            "no plan could be built and run: "
            + "; ".join(f"{k}: {clean_error(m.error or '')}" for k, m in result.end_to_end.items())
        )
    picked: dict[str, str] = {}  # plan key -> label: one label per distinct plan
    mirrors = [f"{b}-only" for b in session.backends if registry.get(b).level.value == "compiler"]
    f32 = None  # with bf16 or int8 on offer, the fastest all-f32 plan is in too: never slower
    if set(REDUCED) & set(session.config.precisions):
        f32 = min(
            (label for label in ok if not has_reduced(result.plans[label])),
            key=lambda label: ok[label].cost_s,
            default=None,
        )
    for label in sorted(ok, key=lambda label: ok[label].cost_s):
        key = plan_key(result.plans[label])
        if (len(picked) < FINALISTS or label in mirrors or label == f32) and key not in picked:
            picked[key] = label
    return {label: result.plans[label] for label in picked.values()}
