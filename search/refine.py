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
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from partune.core import CompilationConfig, DataflowGraph, Plan, Region, SubGraph, region_order
from partune.runners import Measurement
from partune.store import Claims, worker_id

KEEP = "keep"


@dataclass(frozen=True)
class Refined:
    plan: Plan  # the fastest variant measured
    measurement: Measurement
    trials: int  # trials in the study, earlier runs and other workers included
    front: tuple[
        tuple[Plan, Measurement], ...
    ] = ()  # latency+memory: the Pareto front, fastest first
    converged: bool = False  # with patience: stopped because no variant was faster for that long


POLL_S = 2.0  # how often a worker whose budget is spent looks at other workers' trials
NATIVE_MOVE_MAX_NODES = 4  # larger regions moved to native TVM are slow to build and to run


def search_space(
    base: Plan,
    config: CompilationConfig,
    accepted: dict[str, set[int]],
    faster: dict[str, frozenset[int]] | None = None,
) -> list[list[str]]:
    """Per region of ``base``: keep, or a scope of a backend that accepts every one of its
    nodes (named by ``SEScope.choice``: ``backend``, ``backend/bf16``, ``backend/1t``; a
    region may also change precision or thread count alone).

    Moving a region to the native backend (untuned TVM) is offered for small regions only:
    glue is where it wins, and each big one costs a long build to learn that it loses. A
    scope in a reduced precision is offered to a region that holds one of the nodes that
    precision computes ``faster`` (``partune.search.candidates.precision_nodes``), as for
    candidates.
    """
    faster = faster or {}
    native = config.default.backend
    offered = [s for s in config.primitives if s.backend in accepted]
    out = []
    for r in base.regions:
        moves = [
            s.choice
            for s in offered
            if s != r.scope
            and set(r.nodes) <= accepted[s.backend]
            and (s.backend != native or len(r.nodes) <= NATIVE_MOVE_MAX_NODES)
            and not faster.get(s.compute_precision, set(r.nodes)).isdisjoint(r.nodes)
        ]
        out.append([KEEP, *sorted(moves)])
    return out


def variant(
    graph: DataflowGraph, base: Plan, config: CompilationConfig, params: dict
) -> Plan | None:
    """The plan ``params`` describe (None when a merge would make it unrunnable)."""
    regions: list[Region] = []
    for i, r in enumerate(base.regions):
        choice = params.get(f"r{i}", KEEP)
        scope = r.scope if choice == KEEP else config.scope_named(choice)
        region = Region(r.nodes, scope)
        if regions and params.get(f"merge{i}", False) and regions[-1].scope == scope:
            union = tuple(sorted(regions[-1].nodes + r.nodes))
            if SubGraph.of(graph, union).is_convex:
                region = Region(union, scope)
                regions.pop()
        regions.append(region)
    plan = Plan(
        base.model,
        base.fingerprint,
        config,
        tuple(regions),
        notes={"kind": "refined", "params": params},
    )
    try:
        region_order(graph, plan.regions)
    except Exception:  # noqa: BLE001 - a cycle between merged regions: not a plan
        return None
    return plan


def _seed(
    study: optuna.Study, choices: list[list[str]], accepted: dict[str, set[int]], native: str
) -> None:
    """Queue the DP plan and, per backend, "everything it accepts moves to it"."""
    study.enqueue_trial(
        {
            **{f"r{i}": KEEP for i in range(len(choices))},  # the DP plan
            **{f"merge{i}": False for i in range(1, len(choices))},
        }
    )
    for b in accepted:
        if b != native:  # the tvm-only plan was measured already
            study.enqueue_trial(
                {
                    **{f"r{i}": b if b in c else KEEP for i, c in enumerate(choices)},
                    **{f"merge{i}": True for i in range(1, len(choices))},
                }
            )


def _budget_left(study: optuna.Study, n_trials: int) -> bool:
    """Whether the study still needs trials: finished and running ones (any worker's) count.

    Trials a killed worker left RUNNING are failed first (heartbeats; the storage's
    failed-trial callback queues them again), so they neither count nor stay zombies.
    Workers that check at the same moment may overshoot the budget by one trial each.
    """
    with warnings.catch_warnings():  # experimental in Optuna, stable in use since 2.9
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # a no-op on storage without heartbeats
    counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return len(study.get_trials(deepcopy=False, states=counted)) < n_trials


def _converged(study: optuna.Study, patience: int) -> bool:
    """Whether the last ``patience`` finished trials (any worker's) all failed to beat the
    fastest before them: TPE has stopped finding faster variants, or has run out of them (a
    variant measured before is answered from the store, and a pruned one counts as no gain)."""
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    latencies = [t.values[0] if t.values else math.inf for t in finished]
    return len(latencies) > patience and min(latencies[-patience:]) >= min(latencies[:-patience])


def _one_trial(study: optuna.Study, objective: Callable) -> None:
    """One trial; on SQLite two workers may pop one queued (seed) trial, and the one that tells
    second is refused ("Cannot tell a COMPLETE trial"): its measurement is stored, it goes on."""
    try:
        study.optimize(objective, n_trials=1, catch=())
    except ValueError as e:
        if "Cannot tell a" not in str(e):
            raise


def _open_study(
    storage: optuna.storages.BaseStorage,
    study_name: str,
    choices: list[list[str]],
    accepted: dict[str, set[int]],
    config: CompilationConfig,
    n_trials: int,
    seed: int,
    memory: bool,
    claims: Claims | None,
) -> optuna.Study:
    """The study named ``study_name``, created or loaded; the first worker to open it empty
    queues the seeds (TPE, or with ``memory`` NSGA-II on latency and peak memory)."""
    if memory:
        sampler = optuna.samplers.NSGAIISampler(
            seed=seed, population_size=max(4, min(20, n_trials // 2))
        )
        directions = ["minimize", "minimize"]
    else:
        sampler = optuna.samplers.TPESampler(multivariate=True, seed=seed, constant_liar=True)
        directions = ["minimize"]
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=sampler,
        directions=directions,
        load_if_exists=True,
    )
    seeds = f"seeds:{study_name}"
    if not study.trials and (claims is None or claims.claim(seeds)):
        _seed(study, choices, accepted, config.default.backend)
        if claims is not None:
            claims.done(seeds)
    return study


def refine(
    graph: DataflowGraph,
    base: Plan,
    config: CompilationConfig,
    accepted: dict[str, set[int]],
    measure: Callable[[Plan], Measurement],
    storage: optuna.storages.BaseStorage,
    study_name: str,
    n_trials: int,
    *,
    seed: int = 0,
    deadline: float | None = None,
    memory: bool = False,
    claims: Claims | None = None,
    patience: int | None = None,
    space: list[list[str]] | None = None,
) -> Refined | None:
    """Run the study until it holds ``n_trials`` trials (or ``deadline``, ``time.monotonic``,
    passes, or, with ``patience``, that many trials in a row found no faster variant); the
    fastest variant measured, and with ``memory`` the Pareto front.

    ``accepted`` maps each backend on offer to the nodes it accepts; ``measure`` times a
    whole plan (and should store what it measures; with ``memory`` it must report
    ``peak_bytes``). Several workers may run this on one study at once: ``claims`` let
    only one of them queue the seeds, Optuna hands each trial to
    one worker, and the budget counts every worker's trials. With ``memory`` the study
    has two objectives, latency and peak memory, and NSGA-II proposes the variants.
    ``space``: the per-region choices (``search_space``; by default without bf16), which the
    study's name must name (``refine_study_name``): Optuna refuses a study whose choices changed.
    """
    choices = space if space is not None else search_space(base, config, accepted)
    study = _open_study(
        storage, study_name, choices, accepted, config, n_trials, seed, memory, claims
    )
    plans: dict[int, tuple[Plan, Measurement]] = {}

    def objective(trial: optuna.Trial) -> float | tuple[float, float]:
        params = {f"r{i}": trial.suggest_categorical(f"r{i}", c) for i, c in enumerate(choices)}
        params |= {
            f"merge{i}": trial.suggest_categorical(f"merge{i}", [False, True])
            for i in range(1, len(choices))
        }
        trial.set_user_attr("worker", worker_id())
        plan = variant(graph, base, config, params)
        if plan is None:
            raise optuna.TrialPruned("merged regions would form a cycle")
        m = measure(plan)
        plans[trial.number] = (plan, m)
        return _values(m, memory)

    # Until the budget is spent and no trial runs: other workers' last trials may still beat
    # ours, and one of them may turn out dead (its trial is failed on a stale heartbeat,
    # queued again, and run here). Without heartbeats a dead worker's trial would run forever.
    heartbeats = bool(getattr(storage, "heartbeat_interval", None))
    while deadline is None or time.monotonic() < deadline:
        if _budget_left(study, n_trials) and not (patience and _converged(study, patience)):
            _one_trial(study, objective)
        elif heartbeats and study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            time.sleep(POLL_S)
        else:
            break
    done = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if all(math.isfinite(v) for v in t.values)
    ]
    if not done:
        return None

    def rebuilt(t: optuna.trial.FrozenTrial) -> tuple[Plan, Measurement] | None:
        if t.number in plans:
            return plans[t.number]
        plan = variant(graph, base, config, t.params)  # another run's or worker's trial:
        return None if plan is None else (plan, measure(plan))  # measure() answers from the store

    front: tuple[tuple[Plan, Measurement], ...] = ()
    if memory:
        on_front = {t.number for t in study.best_trials}
        unique: dict[tuple, tuple[Plan, Measurement]] = {}  # variants spelled differently, one plan
        for t in sorted(done, key=lambda t: t.values):
            if t.number in on_front and (pm := rebuilt(t)) is not None:
                unique.setdefault(tuple((r.nodes, r.backend) for r in pm[0].regions), pm)
        front = tuple(unique.values())
    best = rebuilt(min(done, key=lambda t: t.values[0]))
    if best is None:
        return None
    return Refined(
        best[0], best[1], len(study.trials), front, bool(patience) and _converged(study, patience)
    )


def _values(m: Measurement, memory: bool) -> float | tuple[float, float]:
    """The objective values of one measured variant: seconds, and with ``memory`` MiB."""
    if not memory:
        return m.cost_s if m.ok else math.inf
    mib = m.peak_bytes / 2**20 if m.ok and m.peak_bytes is not None else math.inf
    return (m.cost_s if m.ok else math.inf), mib
