"""The Collage search: candidates -> measured costs -> cheapest cover -> end-to-end check.

Phases: capture the model's intermediate values (candidates are timed on what they see
inside the model); measure every candidate region on its SEScope; calibrate fixed
per-call costs; DP over measured costs; measure the DP plan, second opinions and every
single-backend plan end to end; learn border costs from those plans and let the DP
propose again (``partune.cost_models.borders``); optionally refine with Optuna (``partune.search.refine``);
then the three fastest plans meet the peers (onnxruntime on the user's model,
torch.compile) in one process, interleaved, and the fastest plan is emitted with its
standing against them.

Every measurement goes through a Runner and into the MeasurementStore the moment it is
taken; anything already stored is reused, so a killed search resumes where it stopped
and a finished one, run again, measures nothing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tvm

from partune.backends import registry
from partune.backends.model_file import sha256
from partune.core.errors import last_line
from partune.core.graph import DataflowGraph
from partune.core.keys import candidate_key, plan_key, region_key, verdict_key
from partune.core.plan import ModelFile, Plan, Region, model_file_plan
from partune.core.scopes import CompilationConfig, SEScope
from partune.core.subgraph import SubGraph
from partune.cost_models.borders import BorderModel, Equation, fit, region_features
from partune.runners.build_pool import BuildPool, Lookahead
from partune.runners.builder import (
    calibration_module,
    compare_request,
    overhead_request,
    plan_request,
    region_request,
    tune_request,
)
from partune.runners.peers import DEFAULT_PEERS, model_origin, peer_kind
from partune.runners.runner import Runner
from partune.runners.timing import Measurement
from partune.search.candidates import (
    Candidate,
    accepted_nodes,
    backend_plan,
    enumerate_candidates,
)
from partune.search.dp import Cover, NoCoverError, cheapest_cover, schedulable
from partune.search.refine import refine
from partune.search.tuning import TuningChoice, tuning_order
from partune.store.measurements import POLL_S, MeasurementStore

# Candidates are timed briefly (many of them); whole plans by the full protocol.
CANDIDATE_PROTOCOL = {"warmup": 1, "warmup_ms": 10.0, "repeat": 5, "min_repeat_ms": 10.0}
PLAN_PROTOCOL = {"warmup": 2, "warmup_ms": 100.0, "repeat": 11, "min_repeat_ms": 50.0}
BORDER_ROUNDS = 3  # DP proposals refined by learned border costs, each measured end to end
FINALISTS = 3
TOP_K = 1  # with a cost model: candidates measured per DP frontier, by predicted cost
EPSILON = 0.05  # ... plus this share of all the rest, drawn at random (the model learns from them)
MAX_PREDICTED_ROUNDS = 40  # DP reruns while its plan still holds predicted regions
# With a cost model, an unmeasured candidate enters the DP at this share of its predicted
# cost: a prediction a little too high then still gets the candidate tried (measured) when
# it is near the best, instead of leaving it out for good.
OPTIMISM = 0.8
VERDICT_ROUNDS = 7
VERDICT_TIMEOUT_S = 900.0  # torch.compile of a whole model inside the measuring process


@dataclass
class Progress:
    """Callbacks a front end implements to show progress (all optional)."""

    start_phase: Callable[[str, int], None] = lambda name, total: None
    advance: Callable[[str], None] = lambda status: None


@dataclass
class TuneResult:
    candidates: int
    plan: Plan | None = None  # the emitted plan: fastest measured end to end
    dp_plan: Plan | None = None
    cover: Cover | None = None
    end_to_end: dict[str, Measurement] = field(default_factory=dict)  # plan label -> measurement
    plans: dict[str, Plan] = field(default_factory=dict)  # plan label -> the plan measured under it
    measured: int = 0
    reused: int = 0
    failed: int = 0
    search_s: float = 0.0
    timed_out: bool = False
    adjust_s: dict[str, float] = field(default_factory=dict)  # per scope: whole-model minus isolated
    border: BorderModel = field(default_factory=BorderModel)  # learned from the plans measured
    dp_label: str | None = None  # the DP's final plan (after border refinement) among end_to_end
    dp_estimate_s: float | None = None  # its cost predicted before it was measured
    inputs_from: str = "model"  # what candidates were measured on: "model" values or "random"
    verdict: dict[str, Measurement] = field(default_factory=dict)  # finalists and peers, interleaved
    skipped: int = 0  # candidates the cost model ranked out of measuring
    trained: list = field(default_factory=list)  # (candidate, measurement) taken this run
    peers: tuple[str, ...] = ()  # which verdict labels are peers (not Partune plans)
    cost_model: object = None  # the cost model after learning from this run's measurements
    tuned_regions: int = 0  # regions tuned (MetaSchedule) by this run
    tuning_trials: int = 0
    tuning_s: float = 0.0
    achieved: dict[str, list[float]] = field(default_factory=dict)  # speed-ups tuning measured, per op kind
    refine_study: str | None = None  # the Optuna study of the refinement
    front: tuple = ()  # latency+memory refinement: the Pareto front, (Plan, Measurement), fastest first

    @property
    def best_peer(self) -> str | None:
        ok = [p for p in self.peers if self.verdict.get(p) is not None and self.verdict[p].ok]
        return min(ok, key=lambda p: self.verdict[p].median_s) if ok else None


def tune(model, backends: list[str], runner: Runner, store: MeasurementStore, *,
         threads: int = 1, pins: dict[int, SEScope] | None = None, deadline: float | None = None,
         progress: Progress | None = None, peers: tuple[str, ...] = DEFAULT_PEERS,
         refine_trials: int = 0, previous: Plan | None = None, cost_model=None, memory: bool = False,
         worker_only: bool = False, tune_budget_s: float = 0.0, tune_trials: int = 32,
         build_pool: BuildPool | None = None) -> TuneResult:
    """Search ``model``'s partitioning over ``backends``; see the module docstring.

    ``previous`` is the plan an earlier run of the same job emitted: it competes again.
    With a ``cost_model`` (``cost_models.CostModel``) only the most promising candidates of
    each DP frontier are measured (``_prune``); the rest enter the DP with predicted costs,
    and any the DP picks are measured before its plan counts.
    Candidates of autotuned backends (tuned TVM) are tuned, ``tune_trials`` per region,
    most expected gain first (``partune.search.tuning``), for at most ``tune_budget_s`` seconds,
    then measured like the rest; a region never tuned is never used.
    ``refine_trials`` plan variants around the DP's plan are measured end to end by an
    Optuna study (``partune.search.refine``); with ``memory`` NSGA-II searches latency and peak
    memory, and the Pareto front is in the result. ``deadline`` (``time.monotonic``)
    stops candidate measuring and refinement; the verdict still runs. Several processes
    may run this on one storage at once: measurements are claimed (``Store.obtain``), so
    none is taken twice, and ``worker_only`` processes stop after refinement. ``peers`` are the tools a user would pick instead
    (``partune.runners.peers``): the finalist plans meet them in one interleaved comparison, and
    the emitted plan is the fastest plan of that comparison, with its standing against
    the best peer in its notes. With a ``build_pool`` (``partune.runners.build_pool``, local runner
    only) candidates are built a few ahead on the cores the measurements do not use.
    """
    progress = progress or Progress()
    start = time.monotonic()
    graph, mod = model.graph, model.mod
    config = CompilationConfig.for_cpu(backends, threads)
    cands = [c for c in enumerate_candidates(mod, graph, config, pins) if schedulable(c)]
    keys = {c: candidate_key(graph, c.subgraph.nodes, c.scope) for c in cands}
    # An autotuned backend's candidates mean nothing untuned: they wait for the tuning phase.
    autotuned = {b for b in backends if registry.get(b).autotuned}
    # Small regions first: the singles alone already give a complete cover.
    todo: dict[str, Candidate] = {}
    for c in sorted(cands, key=lambda c: (len(c.subgraph), c.subgraph.nodes[0])):
        if keys[c] not in store and keys[c] not in todo and c.backend not in autotuned:
            todo[keys[c]] = c
    result = TuneResult(candidates=len(cands))
    result.reused = len({keys[c] for c in cands if c.backend not in autotuned}) - len(todo)
    predicted: dict[Candidate, float] = {}
    if cost_model is not None and todo:
        x = _features(graph, cands)
        predicted, todo = _prune(cands, x, todo, cost_model)
        result.skipped = len({keys[c] for c in cands if keys[c] not in store}) - len(todo)
    values = None

    def measure_candidates(batch: dict[str, Candidate]) -> None:
        nonlocal values
        if batch and values is None:
            values = _capture(model, backends, result, progress) or {}
        progress.start_phase("measure candidates", len(batch))
        # Keys another worker holds are left for last: by then they are usually stored.
        held = {k for k in batch if store.claims.holder(k) is not None}
        order = [k for k in batch if k not in held] + [k for k in batch if k in held]
        ahead = Lookahead(build_pool, order, lambda key: region_request(
            mod, graph, batch[key].subgraph.nodes, batch[key].scope, CANDIDATE_PROTOCOL, values or None))
        for key in order:
            c = batch[key]
            if deadline is not None and time.monotonic() > deadline:
                result.timed_out = True
                break
            m, took = store.obtain(key, lambda key=key: runner.run(ahead.request(key)),
                                   f"{model.name} {c}", deadline)
            if m is None:
                result.timed_out = True
                break
            if took:
                result.measured += 1
                result.failed += not m.ok
                result.trained.append((c, m))
            else:
                result.reused += 1
            progress.advance(f"{c.backend}{c.subgraph}: " + (f"{m.cost_s * 1e6:.0f} us" if m.ok else "failed"))

    measure_candidates(todo)

    def learn() -> None:
        """Refit the cost model on everything measured of this model (from the model it
        came with, not stacked on the last refit) and predict the unmeasured again."""
        nonlocal predicted
        seen = [(i, store.get(keys[c])) for i, c in enumerate(cands)]
        if done := [(i, m.cost_s) for i, m in seen if m is not None and m.ok]:
            idx, seconds = zip(*done, strict=True)
            result.cost_model = cost_model.update(x[list(idx)], np.array(seconds))
            predicted = dict(zip(cands, (float(v) for v in result.cost_model.predict(x)), strict=True))

    if predicted:  # learn from this model's own measurements before the DP trusts the rest
        learn()
    adjust = calibrate(runner, store, config, result)
    result.adjust_s = {k.backend or str(k): v for k, v in adjust.items()}

    tuned: dict[str, str] = {}  # an autotuned candidate's key -> the key of its tuned measurement

    def guess(c: Candidate) -> bool:
        """Whether ``c``'s cost is still the cost model's prediction (not yet measured)."""
        return c in predicted and c.backend not in autotuned and keys[c] not in store

    def cost(c: Candidate) -> float:
        if c.backend in autotuned:
            m = store.get(tuned[keys[c]]) if keys[c] in tuned else None
            return max(m.cost_s + adjust.get(c.scope, 0.0), 0.0) if m is not None and m.ok else float("inf")
        m = store.get(keys[c])
        if m is None and c in predicted:  # not measured (pruned): the cost model's guess, for now,
            # taken optimistically so that the DP tries (and so measures) near misses
            return max(predicted[c] * OPTIMISM + adjust.get(c.scope, 0.0), 0.0)
        if m is None or not m.ok:
            return float("inf")
        return max(m.cost_s + adjust.get(c.scope, 0.0), 0.0)

    if autotuned and tune_budget_s > 0:
        stop = time.monotonic() + tune_budget_s
        others = [c for c in cands if c.backend not in autotuned]
        tunable = [c for c in cands if c.backend in autotuned]
        done: set[str] = set()  # structures tuned (or tried) in this run
        structure = {c: region_key(graph, c.subgraph.nodes) for c in tunable}

        def wanted(order: list[TuningChoice]) -> list[TuningChoice]:
            """The choices the DP would use if they tuned as estimated, most gain first: a
            region tuned is worth it only if the plan can take it. Tuned regions count at
            their measured cost; the others at their estimate."""
            estimate = {t.structure: t.estimate_s for t in order}

            def priced(c: Candidate) -> float:
                if c.backend in autotuned and keys[c] not in tuned:
                    x = estimate.get(structure[c])
                    return math.inf if x is None else max(x + adjust.get(c.scope, 0.0), 0.0)
                return cost(c)

            try:
                cover = cheapest_cover(graph, cands, priced)
            except NoCoverError:
                return []
            used = {structure[c] for c in cover.candidates if c.backend in autotuned and keys[c] not in tuned}
            return [t for t in order if t.structure in used]

        def remaining() -> list[TuningChoice]:
            """The order of what is left to tune, with the speed-ups measured so far."""
            return wanted([t for t in tuning_order(graph, tunable, others, cost, config.default.backend,
                                                   result.achieved) if t.structure not in done])

        order = remaining()
        progress.start_phase("tune regions (MetaSchedule) the DP would use, most expected gain first", len(order))
        while order and (left := min(stop, deadline or stop) - time.monotonic()) > 0:
            choice = order[0]
            done.add(choice.structure)
            key = _autotune(choice.candidate, keys[choice.candidate], tune_trials, left, mod, graph, runner,
                            store, result)
            tuned[keys[choice.candidate]] = key
            if key not in store:
                measure_candidates({key: choice.candidate})
            if math.isfinite(tuned_s := cost(choice.candidate)) and tuned_s > 0:
                result.achieved.setdefault(choice.kind, []).append(choice.untuned_s / tuned_s)
            progress.advance(f"{choice.kind} x{choice.occurrences}: {choice.untuned_s * 1e6:.0f} us untuned, "
                             f"{tuned_s * 1e6:.0f} us tuned, {choice.best_other_s * 1e6:.0f} us elsewhere")
            order = remaining()  # what this kind achieved corrects its prior before the next pick
        result.tuning_s = tune_budget_s - max(stop - time.monotonic(), 0.0)

    contenders = result.plans
    label_of: dict[str, str] = {}  # plan key -> the first label the plan was offered under

    def offer(label: str, plan: Plan, always: bool = False) -> bool:
        """Make ``plan`` a contender under ``label``; False when an equal plan already is one."""
        key = plan_key(plan)
        if key in label_of and not always:
            return False
        label_of.setdefault(key, label)
        contenders[label] = plan
        return True

    features = {c: region_features(graph, c.subgraph.nodes) for c in cands}

    def dp_plan(allowed: set[str], border: BorderModel | None = None) -> tuple[Cover, Plan] | None:
        border = border or BorderModel()

        def priced(c: Candidate) -> float:
            return cost(c) + border.extra_s(features[c])

        for rounds_left in range(MAX_PREDICTED_ROUNDS, -1, -1):
            # The last round trusts no prediction: only measured candidates are left in it.
            usable = [c for c in cands if c.backend in allowed and (rounds_left or not guess(c))]
            try:
                cover = cheapest_cover(graph, usable, priced)
            except NoCoverError:
                return None
            # A plan is never built on predictions: measure its predicted regions, then redo.
            guessed = {keys[c]: c for c in cover.candidates if guess(c)}
            if not guessed:
                break
            measure_candidates(guessed)
            learn()
        regions = tuple(Region(c.subgraph.nodes, c.scope, cost(c)) for c in cover.candidates)
        return cover, Plan(model.name, graph.fingerprint, config, regions,
                           notes={"kind": "collage dp", "estimate_s": cover.cost_s})

    native = config.default

    def second_opinions(border: BorderModel | None = None, suffix: str = "") -> list[str]:
        """The DP restricted to native + one other backend, per backend: a second opinion
        when isolated costs mislead (a plan's parts interact); end to end decides."""
        added = []
        for b in backends if len(backends) > 2 else ():
            if b != native.backend and (alt := dp_plan({native.backend, b}, border)) is not None:
                label = f"partune dp ({native.backend}+{b}){suffix}"
                if offer(label, alt[1]):
                    added.append(label)
        return added

    found = dp_plan(set(backends))
    if found is not None:
        result.cover, result.dp_plan = found
        offer("partune dp", found[1])
    second_opinions()
    for b in backends:
        if b not in autotuned:  # all of a model tuned as one region: not what tuning is budgeted for
            offer(f"{b}-only", backend_plan(model.name, mod, graph, config, b), always=True)
    module_json = tvm.ir.save_json(mod)

    def measure(plan: Plan, label: str, fresh: bool = False) -> Measurement:
        """``fresh``: in a new worker process, so its peak memory is this plan's alone."""
        m, took = store.obtain(plan_key(plan) + (":fresh" if fresh else ""), lambda: runner.run(plan_request(
            module_json, plan, model.inputs, PLAN_PROTOCOL, fresh)), f"{model.name} {label}")
        result.measured += took
        result.failed += took and not m.ok
        result.reused += not took
        progress.advance(f"{label}: " + (f"{m.cost_s * 1e3:.3f} ms" if m.ok else "failed"))
        return m

    def end_to_end(label: str, plan: Plan) -> Measurement:
        result.end_to_end[label] = measure(plan, label)
        return result.end_to_end[label]

    progress.start_phase("measure plans end to end", len(contenders) + BORDER_ROUNDS)
    for label, plan in contenders.items():
        end_to_end(label, plan)

    # Border costs learned from the plans just measured; the DP proposes again with them.
    def equation(plan: Plan, m: Measurement) -> Equation | None:
        costs = [_stored_cost(store, graph, r) for r in plan.regions]
        if not m.ok or any(c is None for c in costs):
            return None
        isolated = sum(c + adjust.get(r.scope, 0.0) for c, r in zip(costs, plan.regions, strict=True))
        feats = sum(region_features(graph, r.nodes) for r in plan.regions)
        return Equation(feats, m.cost_s - isolated, m.cost_s)

    equations = {label: e for label, p in contenders.items()
                 if (e := equation(p, result.end_to_end[label])) is not None}
    dp_label = "partune dp" if found is not None else None
    for k in range(BORDER_ROUNDS):
        result.border = fit(list(equations.values()))
        refined = dp_plan(set(backends), result.border)
        if refined is None:
            break
        label = f"partune dp+borders{'' if k == 0 else f' {k + 1}'}"
        if not offer(label, refined[1]):
            dp_label, (result.cover, result.dp_plan) = label_of[plan_key(refined[1])], refined
            break  # a plan measured already (its regions here carry the DP's costs)
        dp_label = label
        result.cover, result.dp_plan = refined
        m = end_to_end(dp_label, refined[1])
        if (e := equation(refined[1], m)) is not None:
            equations[dp_label] = e
    if result.border.equations:  # second opinions with border costs too
        for label in second_opinions(result.border, "+borders"):
            end_to_end(label, contenders[label])
    # The DP's estimate of its plan, with borders fitted on the other plans only: a prediction.
    if dp_label is not None and result.dp_plan is not None:
        held_out = fit([e for label, e in equations.items() if label != dp_label])
        isolated = sum(r.cost_s or 0.0 for r in result.dp_plan.regions)
        feats = sum(region_features(graph, r.nodes) for r in result.dp_plan.regions)
        result.dp_label, result.dp_estimate_s = dp_label, isolated + held_out.extra_s(feats)
    if refine_trials > 0 and result.dp_plan is not None:
        progress.start_phase("refine plans end to end (Optuna" + (", NSGA-II)" if memory else ")"), refine_trials)
        accepted = {b: accepted_nodes(mod["main"], b) for b in backends if b not in autotuned}
        result.refine_study = refine_study_name(graph, result.dp_plan, memory)
        refined = refine(graph, result.dp_plan, config, accepted,
                         lambda p: measure(p, "refine variant", fresh=memory), store.storage,
                         result.refine_study, refine_trials, deadline=deadline, memory=memory,
                         claim=store.claims.claim)
        if refined is not None:
            result.front = refined.front
            if offer("partune refined", refined.plan):
                result.end_to_end["partune refined"] = refined.measurement
    if worker_only:  # a helper worker: the primary takes it from here
        result.search_s = time.monotonic() - start
        return result
    # A model-file plan is not rebuilt here: its library meets the plans as a peer again.
    if previous is not None and previous.fingerprint == graph.fingerprint and previous.model_file is None:
        if offer("previous best", previous):  # a resumed job never emits worse than before
            end_to_end("previous best", previous)
    ok = {label: m for label, m in result.end_to_end.items() if m.ok}
    if not ok:
        raise RuntimeError("no plan could be built and run: " +
                           "; ".join(f"{k}: {m.error}" for k, m in result.end_to_end.items()))
    # The fastest few, plus each graph-level backend's own plan: those mirror the peers
    # (onnxruntime-only vs onnxruntime on the user's file), so a noisy end-to-end sample
    # can never keep the plan that ties the peer out of the verdict.
    picked: dict[str, str] = {}  # plan key -> label: one label per distinct plan
    mirrors = [f"{b}-only" for b in backends if registry.get(b).level.value == "compiler"]
    for label in sorted(ok, key=lambda label: ok[label].cost_s):
        key = plan_key(contenders[label])
        if (len(picked) < FINALISTS or label in mirrors) and key not in picked:
            picked[key] = label
    finalists = {label: contenders[label] for label in picked.values()}
    _verdict(model, module_json, finalists, peers, runner, store, result, progress)
    judged = {label: m for label, m in result.verdict.items() if label in finalists and m.ok}
    if judged:  # the interleaved medians decide; the search's best samples break no ties here
        best = min(judged, key=lambda label: judged[label].median_s)
    else:
        best = min(ok, key=lambda label: ok[label].cost_s)
    chosen = contenders[best]
    regions = tuple(r if r.cost_s is not None else Region(r.nodes, r.scope, _stored_cost(store, graph, r))
                    for r in chosen.regions)
    notes = {**chosen.notes, "chosen_as": best, "measured_s": ok[best].cost_s,
             "end_to_end_s": {k: v.cost_s for k, v in ok.items()},
             "verdict_median_s": {k: v.median_s for k, v in result.verdict.items() if v.ok},
             "peers": list(result.peers),
             "peers_unavailable": {k: v.error for k, v in result.verdict.items() if k in result.peers and not v.ok}}
    if result.dp_label is not None:
        notes |= {"dp_label": result.dp_label, "dp_estimate_s": result.dp_estimate_s,
                  "border_model": result.border.describe()}
    if result.front:
        notes["pareto_front"] = [{"latency_s": m.cost_s, "peak_bytes": m.peak_bytes, "backends": list(p.backends),
                                  "regions": len(p.regions)} for p, m in result.front]
    file_peer = _fastest_library_peer(result)
    file = None
    if file_peer is not None and (not judged or result.verdict[file_peer].median_s < judged[best].median_s):
        # No plan beat a library on the model's own file: that is the plan (never slower than it).
        file = ModelFile(peer_kind(file_peer), model_origin(model),
                         sha256(model.onnx_bytes) if model.onnx_bytes else None)
        notes |= {"kind": "model file", "chosen_as": file_peer, "measured_s": result.verdict[file_peer].cost_s,
                  "best_partitioned": best,
                  "best_partitioned_median_s": judged[best].median_s if judged else None}
        best, judged = file_peer, {file_peer: result.verdict[file_peer]}
    if (peer := result.best_peer) is not None and best in judged:
        ratio = result.verdict[peer].median_s / judged[best].median_s
        notes |= {"best_peer": peer, "speedup_vs_best_peer": ratio, "beats_best_peer": ratio >= 1.0}
    result.plan = (model_file_plan(model.name, graph, config, file, notes) if file is not None
                   else Plan(chosen.model, chosen.fingerprint, chosen.config, regions, notes=notes))
    result.search_s = time.monotonic() - start
    return result


def _fastest_library_peer(result: TuneResult) -> str | None:
    """The verdict's fastest library peer on the model's own graph (onnxruntime, OpenVINO):
    the one a model-file plan can be made of. None when no such peer ran."""
    from partune.runners.peers import LIBRARY_PEERS

    ok = [p for p in result.peers if peer_kind(p) in LIBRARY_PEERS and result.verdict.get(p) is not None
          and result.verdict[p].ok]
    return min(ok, key=lambda p: result.verdict[p].median_s) if ok else None


def _autotune(c: Candidate, base_key: str, trials: int, left_s: float, mod, graph: DataflowGraph,
              runner: Runner, store: MeasurementStore, result: TuneResult) -> str:
    """Tune ``c``'s region where it will be measured; the key its tuned measurement goes under.

    The key names the budget, so a larger ``--tune-trials`` later tunes further and
    measures again; tuning cut short by the budget gets a key of its own (with the trials
    it got), so the next run resumes it instead of trusting a half-tuned measurement.
    A tuning failure is stored as the failed measurement of that key.
    """
    key = f"{base_key}:tuned{trials}"
    if key in store:
        return key
    report = runner.tune(tune_request(mod, graph, c.subgraph.nodes, c.scope, trials, left_s), left_s + 300.0)
    if "error" in report:
        store.put(key, Measurement.failed(f"tuning: {report['error']}"), f"tuning {c}")
        result.failed += 1
        return key
    result.tuned_regions += report["trials_run"] > 0
    result.tuning_trials += report["trials_run"]
    if report["timed_out"]:
        done = sum(t["records_before"] + t["trials_run"] for t in report["tasks"])
        return f"{base_key}:tuned-partial{done}"
    return key


def refine_study_name(graph: DataflowGraph, dp_plan: Plan, memory: bool) -> str:
    """The refinement study of a model's DP plan (the same for every worker and every rerun)."""
    return f"refine:{graph.fingerprint}:{plan_key(dp_plan)}" + (":latency+memory" if memory else "")


def _features(graph: DataflowGraph, cands: list[Candidate]) -> np.ndarray:
    """The cost model's input, one row per candidate."""
    from partune.cost_models.features import featurize

    return np.stack([featurize(graph, c.subgraph.nodes, c.backend) for c in cands])


def _prune(cands: list[Candidate], x: np.ndarray, todo: dict[str, Candidate], cost_model
           ) -> tuple[dict[Candidate, float], dict[str, Candidate]]:
    """Predicted costs of all candidates, and the part of ``todo`` measured up front.

    A DP frontier is the set of candidates starting at one node (the DP extends the lowest
    uncovered node). Per frontier the ``TOP_K`` cheapest by prediction are measured, and
    ``EPSILON`` of all the others, drawn at random (seeded) over the whole model, so the
    model learns this model's costs where it is unsure. Every frontier keeps at least one
    measured candidate. What else is measured, the DP asks for (``OPTIMISM``).
    """
    import random

    predicted = dict(zip(cands, (float(v) for v in cost_model.predict(x)), strict=True))
    fronts: dict[int, list[tuple[str, Candidate]]] = {}
    for key, c in todo.items():
        fronts.setdefault(c.subgraph.nodes[0], []).append((key, c))
    keep: dict[str, Candidate] = {}
    rest: list[tuple[str, Candidate]] = []
    for members in fronts.values():
        members.sort(key=lambda kc: predicted[kc[1]])
        keep.update(members[:TOP_K])
        rest += members[TOP_K:]
    keep.update(random.Random(0).sample(rest, k=int(np.ceil(EPSILON * len(rest)))))
    return predicted, {k: c for k, c in todo.items() if k in keep}


def _capture(model, backends: list[str], result: TuneResult, progress: Progress):
    """The model's intermediate values, so candidates are measured on what they will see."""
    from partune.runners.capture import capture_values

    progress.start_phase("capture the model's values", 1)
    try:
        values = capture_values(model.mod, model.graph, model.inputs, backends)
    except Exception as e:  # noqa: BLE001 - random inputs are the fallback, and it is reported
        result.inputs_from = f"random ({last_line(e, 100)})"
        values = None
    progress.advance(result.inputs_from)
    return values


def _verdict(model, module_json: str, finalists: dict[str, Plan], peers: tuple[str, ...],
             runner: Runner, store: MeasurementStore, result: TuneResult, progress: Progress) -> None:
    """Finalist plans against the peers, in one process, interleaved; stored like the rest."""
    from partune.runners.peers import available_peers, peer_label, peer_specs

    wanted = available_peers(model, peers)
    key = verdict_key(model.graph.fingerprint, [plan_key(p) for p in finalists.values()], wanted)
    labels = list(finalists) + [peer_label(p, model) for p in wanted]
    progress.start_phase("plans vs peers, interleaved", 1)
    while not all(key + label in store for label in labels):
        if store.claims.claim(key):  # one worker times the verdict; the others wait for it
            specs = peer_specs(model, wanted)
            request = compare_request(module_json, finalists, specs, model.inputs, VERDICT_ROUNDS)
            result.verdict = runner.compare(request, timeout_s=max(VERDICT_TIMEOUT_S, runner.timeout_s))
            for label, m in result.verdict.items():
                store.put(key + label, m, f"{model.name} verdict {label}")
            store.claims.done(key)
            result.measured += len(result.verdict)
            break
        time.sleep(POLL_S)
        store.refresh()
    else:
        result.verdict = {label: store.get(key + label) for label in labels}
        result.reused += len(labels)
    result.peers = tuple(peer_label(p, model) for p in wanted)
    best = min((m.median_s for m in result.verdict.values() if m.ok), default=float("nan"))
    progress.advance(f"fastest median {best * 1e3:.3f} ms")


def calibrate(runner: Runner, store: MeasurementStore, config: CompilationConfig,
              result: TuneResult) -> dict[SEScope, float]:
    """Per scope, what a region costs in the whole model beyond its isolated time.

    An isolated region is called from Python; inside the model the VM calls it. Native
    TVM regions run inline (their isolated VM call is not paid: a negative adjustment);
    a library region pays the VM-to-kernel transition (the penalty Collage lacked).
    Both come from timing the one-add calibration model, isolated and end to end.
    """
    model_json = tvm.ir.save_json(calibration_module())
    graph = DataflowGraph.from_function(calibration_module()["main"])

    def measured(key: str, request: dict, label: str) -> float | None:
        m, took = store.obtain(key, lambda: runner.run(request), label)
        result.measured += took
        result.reused += not took
        return m.cost_s if m.ok else None

    isolated, whole = {}, {}
    for scope in config.primitives:
        tag = json.dumps(scope.to_json(), sort_keys=True)
        isolated[scope] = measured("overhead:" + tag, overhead_request(scope, CANDIDATE_PROTOCOL),
                                   f"{scope} isolated call")
        plan = Plan("calibration", graph.fingerprint, config, (Region((0,), scope),))
        whole[scope] = measured("transition:" + tag, plan_request(model_json, plan, [np.ones(1, "float32")],
                                                                  CANDIDATE_PROTOCOL), f"{scope} in a model")
    native = config.default
    out: dict[SEScope, float] = {}
    if isolated[native] is not None and whole[native] is not None:
        out[native] = -isolated[native]
        for scope in config.primitives:
            if scope == native or isolated[scope] is None or whole[scope] is None:
                continue
            if registry.get(scope.backend).codegen is None:  # inline in main, as native TVM is
                out[scope] = -isolated[scope]
            else:
                out[scope] = max((whole[scope] - isolated[scope]) - (whole[native] - isolated[native]), 0.0)
    return out


def _stored_cost(store: MeasurementStore, graph, region: Region) -> float | None:
    """A region's cost if it was measured as a candidate (single-backend plans' regions)."""
    c = Candidate(SubGraph.of(graph, region.nodes), region.scope, "")
    m = store.get(candidate_key(graph, c.subgraph.nodes, c.scope))
    return m.cost_s if m is not None and m.ok else None
