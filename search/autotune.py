"""The auto-tuning phase: tune (MetaSchedule) the TVM regions the DP would use, most gain first.

A region is worth its tuning time only if the plan can take it once tuned, so each
pick asks the DP which untuned regions it would use if they tuned as estimated
(``partune.search.tuning``), and what a kind of op achieved corrects the estimate of
the next pick. Tuned regions are then measured like any candidate.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from partune.core import region_key
from partune.runners import Measurement, tune_request
from partune.search.candidates import Candidate
from partune.search.dp import NoCoverError, cheapest_cover
from partune.search.tuning import TuningChoice, anchor_kind, tuning_order

if TYPE_CHECKING:
    from partune.search.session_view import SessionView


def autotune(s: SessionView, budget: float) -> None:
    """Tune for at most ``budget`` seconds (and never past the deadline); a long time budget
    also tries regions that only an unusually good tuning would make win (``Budget.optimism``)."""
    optimism = s.options.budget.optimism if s.options.budget is not None else 1.0
    stop = time.monotonic() + budget
    deadline = s.options.deadline or stop
    done: set[str] = set()  # structures tuned (or tried) in this run
    tunable = [c for c in s.cands if c.backend in s.autotuned]
    others = [c for c in s.cands if c.backend not in s.autotuned]
    structure = {c: region_key(s.graph, c.subgraph.nodes) for c in tunable}

    before = achieved_before(s, tunable, others, structure)
    for c in tunable:  # what earlier runs tuned serves the DP now, picked again below or not
        if (key := tuned_key(s, c)) in s.store:
            s.tuned[s.keys[c]] = key

    def remaining() -> list[TuningChoice]:
        """The order of what is left to tune, with the speed-ups measured so far (here, and
        before on this store: a structure this run has tuned counts once, as this run's)."""
        achieved = {k: list(v) for k, v in s.result.tuning.achieved.items()}
        for st, (kind, ratio) in before.items():
            if st not in done:
                achieved.setdefault(kind, []).append(ratio)
        order = tuning_order(
            s.graph, tunable, others, s.cost, s.config.default.backend, achieved, optimism
        )
        return _wanted(s, [t for t in order if t.structure not in done], structure)

    order = remaining()
    s.progress.start_phase(
        "tune regions (MetaSchedule) the DP would use, most expected gain first", len(order)
    )
    while order and (left := min(stop, deadline) - time.monotonic()) > 0:
        choice = order[0]
        done.add(choice.structure)
        key = tune_one(s, choice.candidate, left)
        s.tuned[s.keys[choice.candidate]] = key
        if key not in s.store:
            s.measure_candidates({key: choice.candidate}, phase=False)  # still the tuning phase
        if math.isfinite(tuned_s := s.cost(choice.candidate)) and tuned_s > 0:
            s.result.tuning.achieved.setdefault(choice.kind, []).append(choice.untuned_s / tuned_s)
        s.progress.advance(
            f"{choice.kind} x{choice.occurrences}: {choice.untuned_s * 1e6:.0f} us untuned, "
            f"{tuned_s * 1e6:.0f} us tuned, {choice.best_other_s * 1e6:.0f} us elsewhere"
        )
        order = remaining()  # what this kind achieved corrects its prior before the next pick
    s.result.tuning.seconds = budget - max(stop - time.monotonic(), 0.0)


def achieved_before(
    s: SessionView,
    tunable: list[Candidate],
    others: list[Candidate],
    structure: dict[Candidate, str],
) -> dict[str, tuple[str, float]]:
    """What tuning achieved in earlier runs on this store: per tuned structure, its op kind
    and untuned / tuned. The priors start from it, so that a longer budget does not spend its
    time again on kinds that tuned badly here (a 90-minute mobilenet_v2-small run, with the
    usual priors, tuned 36 regions more after a 30-minute run had tuned 26, none used)."""
    untuned = {
        c.subgraph.nodes: s.store.get(s.keys[c])
        for c in others
        if c.backend == s.config.default.backend
    }
    out: dict[str, tuple[str, float]] = {}
    for c in {s.keys[c]: c for c in tunable}.values():  # one lookup per key: alike regions share it
        tuned, plain = s.store.get(tuned_key(s, c)), untuned.get(c.subgraph.nodes)
        if tuned is not None and plain is not None and tuned.ok and plain.ok and tuned.cost_s > 0:
            out[structure[c]] = (
                anchor_kind(s.graph, c.subgraph.nodes),
                plain.cost_s / tuned.cost_s,
            )
    return out


def _wanted(
    s: SessionView, order: list[TuningChoice], structure: dict[Candidate, str]
) -> list[TuningChoice]:
    """The choices the DP would use if they tuned as estimated, most gain first: a region
    tuned is worth it only if the plan can take it. Tuned regions count at their
    measured cost; the others at their estimate."""
    estimate = {t.structure: t.estimate_s for t in order}

    def untuned(c: Candidate) -> bool:
        return c.backend in s.autotuned and s.keys[c] not in s.tuned

    def priced(c: Candidate) -> float:
        if untuned(c):
            x = estimate.get(structure[c])
            return math.inf if x is None else max(x + s.adjust.get(c.scope, 0.0), 0.0)
        return s.cost(c)

    try:
        cover = cheapest_cover(s.graph, s.cands, priced)
    except NoCoverError:
        return []
    used = {structure[c] for c in cover.candidates if untuned(c)}
    return [t for t in order if t.structure in used]


def tuned_key(s: SessionView, c: Candidate) -> str:
    """The key of ``c``'s region tuned with ``--tune-trials`` trials (``tune_one``)."""
    return f"{s.keys[c]}:tuned{s.options.tune_trials}"


def tune_one(s: SessionView, c: Candidate, left_s: float) -> str:
    """Tune ``c``'s region where it will be measured; the key its tuned measurement goes under.

    The key names the budget, so a larger ``--tune-trials`` later tunes further and
    measures again; tuning cut short by the budget gets a key of its own (with the trials
    it got), so the next run resumes it instead of trusting a half-tuned measurement.
    A tuning failure is stored as the failed measurement of that key.
    """
    trials, base_key, key = s.options.tune_trials, s.keys[c], tuned_key(s, c)
    if key in s.store:
        return key
    request = tune_request(s.mod, s.graph, c.subgraph.nodes, c.scope, trials, left_s)
    report = s.runner.tune(request, left_s + 300.0)
    if "error" in report:
        s.store.put(key, Measurement.failed(f"tuning: {report['error']}"), f"tuning {c}")
        s.counts.failed += 1
        return key
    s.result.tuning.regions += report["trials_run"] > 0
    s.result.tuning.trials += report["trials_run"]
    if report["timed_out"]:
        done = sum(t["records_before"] + t["trials_run"] for t in report["tasks"])
        return f"{base_key}:tuned-partial{done}"
    return key
