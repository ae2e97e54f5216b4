"""The Collage search, as one call: candidates -> measured costs -> cheapest cover -> verdict.

``tune`` runs a ``partune.search.session.SearchSession``, whose docstring lists the
phases; this is the entry point the CLI, the tests and the benchmarks use.
"""

from __future__ import annotations

from partune.core import Plan, SEScope
from partune.runners import DEFAULT_PEERS, BuildPool, Runner
from partune.search.budget import Budget
from partune.search.result import Progress, TuneResult
from partune.search.session import SearchSession, TuneOptions
from partune.store import MeasurementStore

__all__ = ["Progress", "TuneResult", "tune"]


def tune(
    model,
    backends: list[str],
    runner: Runner,
    store: MeasurementStore,
    *,
    threads: int = 1,
    pins: dict[int, SEScope] | None = None,
    deadline: float | None = None,
    progress: Progress | None = None,
    peers: tuple[str, ...] = DEFAULT_PEERS,
    refine_trials: int | None = 0,
    previous: Plan | None = None,
    cost_model=None,
    memory: bool = False,
    worker_only: bool = False,
    tune_budget_s: float = 0.0,
    tune_trials: int = 32,
    build_pool: BuildPool | None = None,
    precision: str = "f32",
    tolerance: float | None = None,
    one_thread_regions: bool = True,
    budget: Budget | None = None,
    calibration: tuple = (),
    validation: tuple = (),
    metric: str = "rel",
) -> TuneResult:
    """Search ``model``'s partitioning over ``backends``; see the module docstring.

    ``previous`` is the plan an earlier run of the same job emitted: it competes again.
    With a ``cost_model`` (``partune.cost_models.base.CostModel``) only the most promising
    candidates of each DP frontier are measured (``partune.search.pruning``); the rest enter the DP
    with predicted costs, and any the DP picks are measured before its plan counts.
    Candidates of autotuned backends (tuned TVM) are tuned, ``tune_trials`` per region,
    most expected gain first (``partune.search.tuning``), for at most ``tune_budget_s`` seconds,
    then measured like the rest; a region never tuned is never used.
    ``refine_trials`` plan variants around the DP's plan are measured end to end by an
    Optuna study (``partune.search.refine``); with ``memory`` NSGA-II searches latency and peak
    memory, and the Pareto front is in the result; ``refine_trials`` None runs it until it
    converges (``partune.search.budget.PATIENCE``) or the deadline. A ``budget``
    (``partune.search.budget``) gives tuning a share of the time left after the candidates
    where ``tune_budget_s`` is 0. ``deadline`` (``time.monotonic``)
    stops candidate measuring and refinement; the verdict still runs. Several processes
    may run this on one storage at once: measurements are claimed (``Store.obtain``), so
    none is taken twice, and ``worker_only`` processes stop after refinement. ``peers``
    are the tools a user would pick instead (``partune.runners.peers``): the finalist plans meet
    them in one interleaved comparison, and the emitted plan is the fastest plan of that comparison,
    with its standing against the best peer in its notes. With a ``build_pool``
    (``partune.runners.build_pool``, local runner only) candidates are built a few ahead on the
    cores the measurements do not use. With ``precision`` "bf16", regions may compute in bf16 where
    a backend has a bf16 path and the CPU bf16 instructions; no plan whose relative error against
    f32 exceeds ``tolerance`` is chosen (``partune.search.precision``); "int8" adds int8 regions,
    their ranges calibrated on ``calibration`` (samples; none: the inputs and draws like them).
    Errors are judged on ``validation`` by ``metric`` (none: the inputs and a held-out draw, by
    relative error). On more than one thread,
    with ``one_thread_regions``, library regions (and single-library plans) may also run on one
    thread (``SEScope.threads``), kept where that measures faster.
    """
    options = TuneOptions(
        threads=threads,
        pins=pins,
        deadline=deadline,
        progress=progress,
        peers=peers,
        refine_trials=refine_trials,
        previous=previous,
        cost_model=cost_model,
        memory=memory,
        worker_only=worker_only,
        tune_budget_s=tune_budget_s,
        tune_trials=tune_trials,
        build_pool=build_pool,
        precision=precision,
        tolerance=tolerance,
        one_thread_regions=one_thread_regions,
        budget=budget,
        calibration=tuple(calibration),
        validation=tuple(validation),
        metric=metric,
    )
    return SearchSession(model, backends, runner, store, options).run()
