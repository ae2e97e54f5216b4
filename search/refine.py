"""Second-level search: plan variants around the DP's plan, measured end to end (Optuna).

The DP adds isolated costs; a real model does not (hand-offs, caches, a graph compiler
that fuses more in one big region than in two small ones). So, as Collage's second
level does, Partune searches plan variants by measuring whole plans: per region of the
DP's plan, keep its backend or move it to another backend that accepts all of its nodes,
and merge it with the next region when both end up on the same backend and the union is
convex. An Optuna study (TPE, multivariate) proposes variants; it is seeded
(``enqueue_trial``) with the DP plan itself and with "everything that backend B accepts
to B", and lives in the same storage as the measurements, so a stopped refinement
resumes. Every variant is measured by the caller's ``measure`` (stored, never twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import optuna

from runners.timing import Measurement
from search.graph import DataflowGraph
from search.plan import Plan, Region, region_order
from search.scopes import CompilationConfig
from search.subgraph import SubGraph

KEEP = "keep"


@dataclass(frozen=True)
class Refined:
    plan: Plan
    measurement: Measurement
    trials: int  # trials in the study, earlier runs included


NATIVE_MOVE_MAX_NODES = 4  # larger regions moved to native TVM are slow to build and to run


def _choices(base: Plan, config: CompilationConfig, accepted: dict[str, set[int]]) -> list[list[str]]:
    """Per region of ``base``: keep, or a backend that accepts every one of its nodes.

    Moving a region to the native backend (untuned TVM) is offered for small regions only:
    glue is where it wins, and each big one costs a long build to learn that it loses.
    """
    native = config.default.backend
    out = []
    for r in base.regions:
        moves = [b for b, ok in accepted.items() if b != r.backend and set(r.nodes) <= ok
                 and (b != native or len(r.nodes) <= NATIVE_MOVE_MAX_NODES)]
        out.append([KEEP, *sorted(moves)])
    return out


def variant(graph: DataflowGraph, base: Plan, config: CompilationConfig, params: dict) -> Plan | None:
    """The plan ``params`` describe (None when a merge would make it unrunnable)."""
    regions: list[Region] = []
    for i, r in enumerate(base.regions):
        choice = params.get(f"r{i}", KEEP)
        scope = r.scope if choice == KEEP else config.scope_for(choice)
        region = Region(r.nodes, scope)
        if regions and params.get(f"merge{i}", False) and regions[-1].scope == scope:
            union = tuple(sorted(regions[-1].nodes + r.nodes))
            if SubGraph.of(graph, union).is_convex:
                region = Region(union, scope)
                regions.pop()
        regions.append(region)
    plan = Plan(base.model, base.fingerprint, config, tuple(regions),
                notes={"kind": "refined", "params": params})
    try:
        region_order(graph, plan.regions)
    except Exception:  # noqa: BLE001 - a cycle between merged regions: not a plan
        return None
    return plan


def refine(graph: DataflowGraph, base: Plan, config: CompilationConfig, accepted: dict[str, set[int]],
           measure: Callable[[Plan], Measurement], storage: optuna.storages.BaseStorage, study_name: str,
           n_trials: int, seed: int = 0) -> Refined | None:
    """Run the study until it holds ``n_trials`` trials; the fastest variant measured.

    ``accepted`` maps each backend on offer to the nodes it accepts; ``measure`` times a
    whole plan (and should store what it measures).
    """
    choices = _choices(base, config, accepted)
    sampler = optuna.samplers.TPESampler(multivariate=True, seed=seed, constant_liar=True)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                direction="minimize", load_if_exists=True)
    if not study.trials:
        study.enqueue_trial({**{f"r{i}": KEEP for i in range(len(choices))},  # the DP plan
                             **{f"merge{i}": False for i in range(1, len(choices))}})
        for b in accepted:
            if b == config.default.backend:
                continue  # the tvm-only plan was measured already
            study.enqueue_trial({**{f"r{i}": b if b in c else KEEP for i, c in enumerate(choices)},
                                 **{f"merge{i}": True for i in range(1, len(choices))}})
    plans: dict[int, tuple[Plan, Measurement]] = {}

    def objective(trial: optuna.Trial) -> float:
        params = {f"r{i}": trial.suggest_categorical(f"r{i}", c) for i, c in enumerate(choices)}
        params |= {f"merge{i}": trial.suggest_categorical(f"merge{i}", [False, True])
                   for i in range(1, len(choices))}
        plan = variant(graph, base, config, params)
        if plan is None:
            raise optuna.TrialPruned("merged regions would form a cycle")
        m = measure(plan)
        plans[trial.number] = (plan, m)
        return m.cost_s if m.ok else math.inf

    todo = n_trials - len([t for t in study.trials if t.state.is_finished()])
    if todo > 0:
        study.optimize(objective, n_trials=todo, catch=())
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and math.isfinite(t.value)]
    if not done:
        return None
    best = min(done, key=lambda t: t.value)
    if best.number in plans:
        plan, m = plans[best.number]
    else:  # found by an earlier run: rebuild it; measure() answers from the store
        plan = variant(graph, base, config, best.params)
        if plan is None:
            return None
        m = measure(plan)
    return Refined(plan, m, len(study.trials))
