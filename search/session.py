"""The Collage search as a session: one object holds what the phases share, one method a phase.

Phases, in the order ``run`` calls them: capture the model's intermediate values
(candidates are timed on what they see inside the model); measure every candidate
region on its SEScope; learn (a cost model, when there is one); calibrate fixed
per-call costs; auto-tune the TVM regions the DP would use; propose plans (the DP,
second opinions, every single-backend plan) and measure them end to end; learn border
costs from those plans and let the DP propose again (``partune.search.border_rounds``);
refine with Optuna; then the fastest plans (both in ``partune.search.finalists``) meet the peers in
one interleaved comparison (``partune.search.verdict``) and the emitted plan says how it stands
against the best of them.

Every measurement goes through a Runner and into the MeasurementStore the moment it is
taken; anything already stored is reused, so a killed search resumes where it stopped
and a finished one, run again, measures nothing.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import numpy as np

from partune.backends import registry
from partune.core import (
    INT8,
    PRECISIONS,
    REDUCED,
    Calibration,
    CompilationConfig,
    Plan,
    Region,
    SEScope,
    candidate_key,
    clean_error,
    last_line,
    plan_key,
    region_label,
    scope_name,
    trim,
    variant_label,
)
from partune.cost_models import BorderModel, region_features
from partune.runners import (
    Lookahead,
    Measurement,
    Runner,
    has_reduced,
    module_file,
    plan_request,
    region_request,
)
from partune.search.border_rounds import BORDER_ROUNDS, border_rounds
from partune.search.calibration import CalibrationView, calibrate
from partune.search.candidates import Candidate, backend_plan, enumerate_candidates
from partune.search.dp import Cover, NoCoverError, cheapest_cover, schedulable
from partune.search.finalists import pick_finalists, refinement
from partune.search.int8_calibration import calibrate_int8, calibration_samples, validation_for
from partune.search.options import TuneOptions
from partune.search.precision import budgeted, repair, worth_repairing
from partune.search.pruning import Optimism, features, prune
from partune.search.result import Counts, Progress, TuneResult
from partune.store import FIRST_POLL_S, POLL_S, MeasurementStore

# Candidates are timed briefly (many of them); whole plans by the full protocol.
CANDIDATE_PROTOCOL = {"warmup": 1, "warmup_ms": 10.0, "repeat": 5, "min_repeat_ms": 10.0}
PLAN_PROTOCOL = {"warmup": 2, "warmup_ms": 100.0, "repeat": 11, "min_repeat_ms": 50.0}
# A repair's probe is read for its error alone: one timed call, not the 0.7 s of a contender's.
PROBE_PROTOCOL = {"warmup": 1, "warmup_ms": 0.0, "repeat": 1, "min_repeat_ms": 0.0}
# A native-only plan or a refinement variant whose measured regions add up to this many times
# the fastest plan timed is not timed: untuned TVM ran a BERT-768 in 5.9 s (27 ms the best), 83 s
# of a 10-minute search.
HOPELESS = 10.0
NOT_MEASURED = (
    "not measured"  # how such a plan's measurement begins (the summary shows it as skipped)
)
MAX_PREDICTED_ROUNDS = 40  # DP reruns while its plan still holds predicted regions


class SearchSession:
    """One search of one model over some backends; ``run`` it once."""

    def __init__(
        self,
        model,
        backends: list[str],
        runner: Runner,
        store: MeasurementStore,
        options: TuneOptions,
    ) -> None:
        self.model, self.backends, self.runner, self.store, self.options = (
            model,
            backends,
            runner,
            store,
            options,
        )
        self.progress = options.progress or Progress()
        self.graph, self.mod = model.graph, model.mod
        bf16 = registry.bf16_names(backends) if options.precision in REDUCED else ()
        int8 = registry.int8_names(backends) if options.precision == INT8 else ()
        fewer = registry.threads_per_region_names(backends) if options.one_thread_regions else ()
        self.config = CompilationConfig.for_cpu(
            backends, options.threads, bf16=bf16, one_thread=fewer, int8=int8
        )
        self.calibration: Calibration | None = None  # int8's ranges, measured before any plan
        self.validation = validation_for(model, options)
        self.cands = [
            c
            for c in enumerate_candidates(self.mod, self.graph, self.config, options.pins)
            if schedulable(c)
        ]
        self.keys = {c: candidate_key(self.graph, c.subgraph.nodes, c.scope) for c in self.cands}
        # An autotuned backend's candidates mean nothing untuned: they wait for the tuning phase.
        self.autotuned = {b for b in backends if registry.get(b).autotuned}
        self.result = TuneResult(counts=Counts(candidates=len(self.cands)))
        self.predicted: dict[Candidate, float] = {}
        self.optimism = Optimism()  # the share of its prediction an unmeasured candidate costs
        self.x: np.ndarray | None = None  # cost-model features, one row per candidate
        self.values: dict | None = None  # the model's intermediate values, once captured
        self.adjust: dict[SEScope, float] = {}
        self.tuned: dict[
            str, str
        ] = {}  # an autotuned candidate's key -> the key of its tuned measurement
        self.label_of: dict[str, str] = {}  # plan key -> the first label the plan was offered under
        self.features = {c: region_features(self.graph, c.subgraph.nodes) for c in self.cands}
        self.calibrated: set[str] = set()  # calibration keys this session measured

    @property
    def counts(self) -> Counts:
        return self.result.counts

    @cached_property
    def module_file(
        self,
    ) -> Path:  # written when first sent: a search whose plans are all stored skips it
        self._scratch = tempfile.TemporaryDirectory(
            prefix="partune-model-"
        )  # removed with the session
        return module_file.write(self.mod, self._scratch.name)

    def run(self) -> TuneResult:
        from partune.search.autotune import autotune
        from partune.search.verdict import await_verdict, emit, fit_in_memory, judge

        start = time.monotonic()
        # The calibration's keys are taken by the workers that run out of candidates first, while
        # the last candidates are measured: calibrating after them would leave all but one waiting.
        self.measure_candidates(self.first_batch(), meanwhile=lambda: self.calibrate(early=True))
        if self.predicted:  # learn from this model's own measurements before the DP trusts the rest
            self.learn()
        self.adjust = self.calibrate()
        self.result.adjust_s = {scope_name(k): v for k, v in self.adjust.items()}
        if INT8 in self.config.precisions:
            self.calibration = calibrate_int8(self, calibration_samples(self.model, self.options))
        opts = self.options
        tune_s = opts.tune_budget_s or (opts.budget.tuning_s() if opts.budget is not None else 0.0)
        if self.autotuned and tune_s > 0:
            autotune(self, tune_s)
        self.propose()
        border_rounds(self)
        refinement(self)
        if not self.options.worker_only:  # a helper worker: the primary takes it from here
            finalists = fit_in_memory(self, pick_finalists(self))
            await_verdict(self, finalists)
            judge(self, finalists)
            emit(self, finalists)
        self.result.search_s = time.monotonic() - start
        return self.result

    # -- candidates -------------------------------------------------------------------

    def first_batch(self) -> dict[str, Candidate]:
        """The candidates to measure up front: all not stored, or the cost model's pick of them."""
        keys, store = self.keys, self.store
        todo: dict[str, Candidate] = {}
        # Small regions first: the singles alone already give a complete cover.
        for c in sorted(self.cands, key=lambda c: (len(c.subgraph), c.subgraph.nodes[0])):
            if keys[c] not in store and keys[c] not in todo and c.backend not in self.autotuned:
                todo[keys[c]] = c
        self.counts.reused = len(
            {keys[c] for c in self.cands if c.backend not in self.autotuned}
        ) - len(todo)
        if self.options.cost_model is not None and todo:
            self.x = features(self.graph, self.cands)
            self.predicted, todo = prune(self.cands, self.x, todo, self.options.cost_model)
            self.counts.skipped = len({keys[c] for c in self.cands if keys[c] not in store}) - len(
                todo
            )
        return todo

    def capture(self) -> dict:
        """The model's intermediate values, so candidates are measured on what they will see
        (captured where the runner says: ``Runner.captured``)."""
        self.progress.start_phase("capture the model's values", 1)
        try:
            values = self.runner.captured(
                self.mod,
                self.graph,
                self.model.inputs,
                self.backends,
                self.module_file if self.runner.reads_local_files else None,
            )
        except Exception as e:  # noqa: BLE001 - random inputs are the fallback, and it is reported
            self.result.inputs_from = f"random ({clean_error(last_line(e), 240)})"
            values = None
        self.progress.advance(self.result.inputs_from)
        trim()  # the whole-model build that captured them is gone: BERT-768 12 layers 4.4 -> 2.9 GB
        return values or {}

    def measure_candidates(
        self, batch: dict[str, Candidate], meanwhile=None, phase: bool = True
    ) -> None:
        """Measure ``batch`` (key -> candidate) in order; a deadline stops it. ``meanwhile``
        runs once no key is left that another worker holds, before those are waited for.
        Without ``phase`` the measuring is part of the phase under way (a tuned region's)."""
        if batch and self.values is None:
            self.values = self.capture()
        if phase:
            self.progress.start_phase("measure candidates", len(batch))
        # Keys another worker holds are left for last: by then they are usually stored.
        held = {k for k in batch if self.store.claims.holder(k) is not None}
        order = [k for k in batch if k not in held] + [k for k in batch if k in held]
        ahead = Lookahead(
            self.options.build_pool,
            order,
            lambda key: region_request(
                self.mod,
                self.graph,
                batch[key].subgraph.nodes,
                batch[key].scope,
                CANDIDATE_PROTOCOL,
                self.values or None,
                model_file=self.module_file if self.runner.reads_local_files else None,
            ),
        )
        # Keys another worker is measuring are skipped, then waited for once the rest are done:
        # workers on one storage split the work instead of queueing behind each other.
        deferred = self._measure(batch, order, ahead, wait=False, shown=phase)
        if meanwhile is not None:
            meanwhile()
            if deferred and phase:
                self.progress.start_phase("measure candidates", len(deferred))
        self._measure(batch, deferred, ahead, wait=True, shown=phase)

    def _measure(
        self,
        batch: dict[str, Candidate],
        keys: list[str],
        ahead: Lookahead,
        wait: bool,
        shown: bool = True,
    ) -> list[str]:
        """Measure ``keys`` in order; without ``wait``, the keys other workers held are returned."""
        deadline, deferred = self.options.deadline, []
        for key in keys:
            c = batch[key]
            if deadline is not None and time.monotonic() > deadline:
                self.result.timed_out = True
                break
            m, took = self.obtain(
                key,
                lambda key=key: self.runner.run(ahead.request(key)),
                f"{self.model.name} {c}",
                deadline,
                wait,
            )
            if m is None and not wait and (deadline is None or time.monotonic() <= deadline):
                deferred.append(key)
                continue
            if m is None:
                self.result.timed_out = True
                break
            self.counts.took(took, m.ok)
            if took:
                self.result.trained.append((c, m))
            if shown:
                self.progress.advance(
                    f"{c.backend} {region_label(self.graph, c.subgraph.nodes, width=32)}: "
                    + (f"{m.cost_s * 1e6:.0f} us" if m.ok else "failed")
                )
        return deferred

    def obtain(
        self, key: str, take, label: str, deadline: float | None = None, wait: bool = True
    ) -> tuple[Measurement | None, bool]:
        """``store.obtain``, but a wait on another worker's claim looks again soon and backs
        off (``FIRST_POLL_S`` doubling to ``POLL_S``) instead of sleeping ``POLL_S`` each time."""
        pause = FIRST_POLL_S
        while True:
            m, took = self.store.obtain(key, take, label, deadline, wait=False)
            if m is not None or not wait or (deadline is not None and time.monotonic() > deadline):
                return m, took
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)

    def calibrate(self, early: bool = False) -> dict[SEScope, float]:
        """Fixed per-call costs (``partune.search.calibration``), each key measured once by
        whichever worker claims it. ``early``: only the keys nobody holds are taken, and the
        result is not for use; later, without it, every key is read (or waited for)."""
        self.progress.start_phase("calibrate per-call costs", 2 * len(self.config.primitives))
        return calibrate(
            self.runner, CalibrationView(self, early), self.config, Counts(), CANDIDATE_PROTOCOL
        )

    def learn(self) -> None:
        """Refit the cost model on everything measured of this model (from the model it
        came with, not stacked on the last refit) and predict the unmeasured again."""
        seen = [(i, self.store.get(self.keys[c])) for i, c in enumerate(self.cands)]
        if done := [(i, m.cost_s) for i, m in seen if m is not None and m.ok]:
            idx, seconds = zip(*done, strict=True)
            model = self.options.cost_model.update(self.x[list(idx)], np.array(seconds))
            self.result.cost_model = model
            self.predicted = dict(
                zip(self.cands, (float(v) for v in model.predict(self.x)), strict=True)
            )

    def guess(self, c: Candidate) -> bool:
        """Whether ``c``'s cost is still the cost model's prediction (not yet measured)."""
        return (
            c in self.predicted
            and c.backend not in self.autotuned
            and self.keys[c] not in self.store
        )

    def cost(self, c: Candidate) -> float:
        """``c``'s cost inside the model: measured, else predicted (optimistically), else inf."""
        adjust = self.adjust.get(c.scope, 0.0)
        if c.backend in self.autotuned:
            m = self.store.get(self.tuned[self.keys[c]]) if self.keys[c] in self.tuned else None
            return max(m.cost_s + adjust, 0.0) if m is not None and m.ok else float("inf")
        m = self.store.get(self.keys[c])
        if (
            m is None and c in self.predicted
        ):  # not measured (pruned): the cost model's guess, for now,
            # taken optimistically so that the DP tries (and so measures) near misses
            return max(self.predicted[c] * self.optimism.share + adjust, 0.0)
        if m is None or not m.ok:
            return float("inf")
        return max(m.cost_s + adjust, 0.0)

    def stored_cost(self, region: Region) -> float | None:
        """A region's cost if it was measured as a candidate (single-backend plans' regions)."""
        m = self.store.get(
            candidate_key(self.graph, tuple(sorted(set(region.nodes))), region.scope)
        )
        return m.cost_s if m is not None and m.ok else None

    # -- plans ------------------------------------------------------------------------

    def dp(
        self,
        allowed: set[str],
        border: BorderModel | None = None,
        precisions: tuple[str, ...] = PRECISIONS,
    ) -> tuple[Cover, Plan] | None:
        """The cheapest cover over ``allowed`` backends in ``precisions``; predicted regions it
        picks are measured."""
        border = border or BorderModel()

        def priced(c: Candidate) -> float:
            return self.cost(c) + border.extra_s(self.features[c])

        for rounds_left in range(MAX_PREDICTED_ROUNDS, -1, -1):
            # The last round trusts no prediction: only measured candidates are left in it.
            usable = [
                c
                for c in self.cands
                if c.backend in allowed
                and c.scope.compute_precision in precisions
                and (rounds_left or not self.guess(c))
            ]
            try:
                cover = cheapest_cover(self.graph, usable, priced)
            except NoCoverError:
                return None
            # A plan is never built on predictions: measure its predicted regions, then redo.
            guessed = {self.keys[c]: c for c in cover.candidates if self.guess(c)}
            if not guessed:
                break
            self.measure_candidates(guessed)
            self.optimism.observe(
                (self.predicted[c], m.cost_s)
                for k, c in guessed.items()
                if (m := self.store.get(k)) is not None and m.ok
            )
            self.learn()
        regions = tuple(Region(c.subgraph.nodes, c.scope, self.cost(c)) for c in cover.candidates)
        return cover, self.with_ranges(
            Plan(
                self.model.name,
                self.graph.fingerprint,
                self.config,
                regions,
                notes={"kind": "collage dp", "estimate_s": cover.cost_s},
            )
        )

    def with_ranges(self, plan: Plan) -> Plan:
        """``plan`` with the int8 ranges where it has int8 regions (the ranges are the plan's:
        its export computes with them). Every plan the session makes gets them where it is made
        (the DP's), or where it is offered or measured, so its key is the same everywhere."""
        if INT8 in plan.precisions and plan.calibration is None:
            return replace(plan, calibration=self.calibration)
        return plan

    def offer(self, label: str, plan: Plan, always: bool = False) -> bool:
        """Make ``plan`` a contender under ``label``; False when an equal plan already is one."""
        plan = self.with_ranges(plan)
        key = plan_key(plan)
        if key in self.label_of and not always:
            return False
        self.label_of.setdefault(key, label)
        self.result.plans[label] = plan
        return True

    def second_opinions(self, border: BorderModel | None = None, suffix: str = "") -> list[str]:
        """The DP restricted to native + one other backend, per backend: a second opinion
        when isolated costs mislead (a plan's parts interact); end to end decides."""
        native, added = self.config.default, []
        for b in self.backends if len(self.backends) > 2 else ():
            if b != native.backend and (alt := self.dp({native.backend, b}, border)) is not None:
                label = f"partune dp ({native.backend}+{b}){suffix}"
                if self.offer(label, alt[1]):
                    added.append(label)
        return added

    def measure(
        self,
        plan: Plan,
        label: str,
        fresh: bool = False,
        wait: bool = True,
        metric: str | None = None,
    ) -> Measurement | None:
        """``plan`` end to end; ``fresh``: in a new worker process, so its peak memory is its own.
        Without ``wait``, None when another worker is measuring it (come back for it). ``metric``:
        its error by that metric on the same validation samples, not held to the budget and
        timed once (a repair's probe, ``partune.search.precision.probe_metric``; stored apart
        from the plan's own measurement)."""
        plan = self.with_ranges(plan)
        judged = self.validation if has_reduced(plan) else None
        if judged is not None and metric is not None and metric != judged.metric:
            judged = replace(judged, metric=metric)
        protocol = PLAN_PROTOCOL if metric is None else PROBE_PROTOCOL
        m, took = self.obtain(
            plan_key(plan)
            + (":fresh" if fresh else "")
            + (f":judged:{judged.digest}" if judged else "")
            + ("" if metric is None else ":probe"),
            lambda: self.runner.run(
                plan_request(self.module_file, plan, self.model.inputs, protocol, fresh, judged)
            ),
            f"{self.model.name} {label}",
            wait=wait,
        )
        if m is None:
            return None
        self.counts.took(took, m.ok)
        if metric is None:  # a plan beyond the accuracy budget is a failed plan
            m = budgeted(m, self.options.tolerance, self.options.metric)
        self.progress.advance(f"{label}: " + (f"{m.cost_s * 1e3:.3f} ms" if m.ok else "failed"))
        return m

    def end_to_end(self, label: str, plan: Plan) -> Measurement:
        """Measure a contender end to end and record it under ``label``."""
        self.result.end_to_end[label] = self.measure(plan, label)
        return self.result.end_to_end[label]

    def end_to_end_all(self, plans: dict[str, Plan]) -> None:
        """Measure these contenders end to end (recorded in their order): the ones no other
        worker is measuring first, then the rest, waited for; workers sharing the search
        split the plans instead of queueing behind one another."""
        measured = {
            label: m
            for label, plan in plans.items()
            if (m := self.measure(plan, label, wait=False)) is not None
        }
        for label, plan in plans.items():
            self.result.end_to_end[label] = measured.get(label) or self.measure(plan, label)

    def propose(self) -> None:
        """The DP's plan, its second opinions and every single-backend plan, measured end to end."""
        found = self.dp(set(self.backends))
        if found is not None:
            self.result.cover, self.result.dp_plan = found
            self.result.dp_label = "partune dp"
            self.offer("partune dp", found[1])
        if set(REDUCED) & set(self.config.precisions) and (
            f32 := self.dp(set(self.backends), precisions=("f32",))
        ):
            self.offer(
                "partune dp (f32)", f32[1]
            )  # what the DP takes in f32 alone: never emitted slower
        self.second_opinions()
        proposed = dict(self.result.plans)
        for b in self.backends:
            if (
                b not in self.autotuned
            ):  # all of a model tuned as one region: not what tuning is budgeted for
                for precision, threads in self.config.variants:
                    if any(
                        s.backend == b and (s.compute_precision, s.threads) == (precision, threads)
                        for s in self.config.primitives
                    ):
                        self.offer(
                            f"{b}-only" + variant_label(precision, threads),
                            backend_plan(
                                self.model.name,
                                self.mod,
                                self.graph,
                                self.config,
                                b,
                                precision,
                                threads,
                            ),
                            always=True,
                        )
        self.progress.start_phase(
            "measure plans end to end", len(self.result.plans) + BORDER_ROUNDS
        )
        self.end_to_end_all(proposed)
        self.end_to_end_all(
            self.worth_timing(
                {label: plan for label, plan in self.result.plans.items() if label not in proposed}
            )
        )
        # Over budget, the DP's plan and each library's whole-model int8 plan (one region: no
        # borders) are repaired: units, then regions, handed back to f32.
        for label in [
            label
            for label in self.result.plans
            if label == "partune dp" or label.endswith("-only (int8)")
        ]:
            if worth_repairing(self.result.end_to_end[label], self.fastest_timed()):
                repair(self, self.result.plans[label], label)

    def worth_timing(self, plans: dict[str, Plan]) -> dict[str, Plan]:
        """``plans`` less the native-only ones (f32 and bf16) where the f32 one's measured regions
        add up to ``HOPELESS`` times the fastest plan timed: they are recorded as not measured.
        (TVM's bf16 ran a matmul 3.6x faster than its f32, not 10x: mobilevit's 261 ms was
        timed.)"""
        native = self.config.default
        natives = [
            label
            for label, plan in plans.items()
            if all(replace(r.scope, precision=None) == native for r in plan.regions)
        ]
        timed = natives and self.fastest_timed() < float(
            "inf"
        )  # else nothing to be hopeless against
        estimate = self.native_estimate(native) if timed else None
        skipped = self.hopeless(estimate) if estimate is not None else None
        if skipped is None:
            return plans
        for label in natives:
            self.result.end_to_end[label] = skipped
            self.progress.advance(f"{label}: {NOT_MEASURED}")
        return {label: plan for label, plan in plans.items() if label not in natives}

    def native_estimate(self, native: SEScope) -> float | None:
        """What the cheapest cover in ``native`` alone adds up to (None: none covers). The
        cost model's guesses stand in for unmeasured regions, and the DP measures them only where
        those guesses are not already hopeless: at a later ``--shapes`` bucket the TVM-only cover
        asked for 23 candidates, minutes of untuned kernels, only to be found 74x too slow."""
        within = (native.backend, native.compute_precision)
        usable = [c for c in self.cands if (c.backend, c.scope.compute_precision) == within]
        try:
            guessed = cheapest_cover(self.graph, usable, self.cost).cost_s
        except NoCoverError:
            return None
        if self.hopeless(guessed) is not None:
            return guessed
        found = self.dp({native.backend}, precisions=(native.compute_precision,))
        return found[0].cost_s if found is not None else None

    def fastest_timed(self) -> float:
        """The fastest end-to-end time of any plan so far (inf: none timed yet)."""
        return min(
            (m.cost_s for m in self.result.end_to_end.values() if m.ok), default=float("inf")
        )

    def hopeless(self, estimate_s: float) -> Measurement | None:
        """Why a plan whose measured regions add up to ``estimate_s`` is not worth timing: over
        ``HOPELESS`` times the fastest plan timed (untuned TVM ran BERT-768 in 5.9 s against
        27 ms; a refinement variant with its matmuls 7 s against 0.32 s at 24 layers). None: it
        is."""
        best = self.fastest_timed()
        if not estimate_s > HOPELESS * best:
            return None
        return Measurement.failed(
            f"{NOT_MEASURED}: its regions add up to {estimate_s * 1e3:.1f} ms, "
            f"{estimate_s / best:.0f}x the fastest plan timed"
        )
