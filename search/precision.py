"""bf16 and int8 regions within the user's accuracy budget (``--precision bf16|int8
--tolerance REL``).

Each bf16 or int8 region is measured like any candidate, and the DP takes it where it is faster.
But errors that are small per region add up through a model, so the budget is judged on
whole plans only: every plan with such regions is measured end to end with its error
against its f32 twin (``partune.runners.accuracy``), and a plan over budget counts as
failed for everything that chooses (the DP's rounds, refinement, the finalists, the
emitted plan). An over-budget plan is repaired (``repair``): first unit by unit, keeping some
int8 matmuls and convolutions in f32 inside the same regions (no new borders; NNCF's accuracy
control does this by sensitivity alone, here by FLOPs given up per unit of error removed), then
region by region, those that cost least speed per unit of error handed back to f32 first.
Where the budget leaves little of the plan's noise, the units are taken the other way: each
one's error alone is measured and int8 is kept where it buys most FLOPs per unit of noise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from partune.backends import registry
from partune.core import (
    INPUTS,
    attention_operands,
    int8_units,
    main_bindings,
    quantizes,
    unit_noise,
)
from partune.runners import ERROR_NAMES, Measurement, has_reduced
from partune.search.int8_calibration import calibrated_tensors

if TYPE_CHECKING:
    from partune.core import Plan, Region
    from partune.search.session_view import SessionView

MAX_REPAIRS = 4  # plans measured while handing regions back, before all go back at once
MAX_SENSITIVITIES = 8  # reduced regions whose errors alone are measured to order the repair
# int8 units whose share of the error is measured (most estimated noise first): densenet's 37 took
# 100 s a plan at 1 thread, and found the error spread over them all
MAX_UNIT_PROBES = 16
MAX_UNIT_STEPS = 5  # variants measured while handing int8 units back to f32
# Where the budget leaves less than this share of the whole plan's noise, the repair builds the
# int8 set up from f32 instead (``build_up_units``): shares measured by taking one unit out of
# a plan whose noise must nearly all go are differences of two near-equal errors.
BUILD_UP_BELOW = 0.5
# int8 units whose error alone is measured when building up (most FLOPs first): a random-weight
# ResNet-50's 54 convolutions ranged 1.7e-3 to 1.5e-1 alone, so the few that carry the noise
# must be found among all of them.
MAX_ALONE_PROBES = 64
AIM = 0.7  # of the budget: where the first variant handing units back aims its error
# A metric that steps (top-1: a share of samples) barely moves when one unit or region goes back
# to f32, so a repair's probes read a continuous one on the same samples in its stead.
PROBE_METRICS = {"top1": "rel"}


def probe_metric(metric: str) -> str:
    """What a repair's probes measure for a search judged by ``metric``."""
    return PROBE_METRICS.get(metric, metric)


@dataclass(frozen=True)
class NoiseScale:
    """A repair's arithmetic: errors as the noise that adds up over independent units (squared
    relative error; cosine error as it is), in the probes' metric.

    ``per`` is the user's metric per unit of the probes' (1 where they are one metric): under
    top-1 agreement, the share of flipped classes grows in proportion to the relative error
    (classes flip where the error crosses the margin), at the rate the whole plan's two errors
    give."""

    power: float  # an error e adds over units as e ** (1 / power)
    per: float = 1.0

    @classmethod
    def of(cls, probe: str, per: float = 1.0) -> NoiseScale:
        return cls(1.0 if probe == "cosine" else 0.5, per)

    def noise(self, error: float, probed: bool = False) -> float:
        """The noise behind an error by the user's metric (``probed``: by the probes')."""
        return (error if probed else error / self.per) ** (1 / self.power)


def over_budget(m: Measurement, tolerance: float | None) -> bool:
    return (
        tolerance is not None and m.ok and m.rel_error is not None and not m.rel_error <= tolerance
    )


def budgeted(m: Measurement, tolerance: float | None, metric: str = "rel") -> Measurement:
    """``m`` as the search sees it: a failure when its plan strays beyond ``tolerance`` (its
    error by ``metric``)."""
    if not over_budget(m, tolerance):
        return m
    name = ERROR_NAMES.get(metric, metric)
    return replace(
        Measurement.failed(f"over the accuracy budget: {name} {m.rel_error:.2g} > {tolerance:.2g}"),
        rel_error=m.rel_error,
        best_s=m.best_s,  # what it ran in, for ``worth_repairing``; its cost_s stays inf
    )


def overran(m: Measurement) -> bool:
    """Whether ``m`` (as ``budgeted`` gave it) failed for its error alone."""
    return not m.ok and m.rel_error is not None


def worth_repairing(m: Measurement, fastest_s: float) -> bool:
    """Whether an over-budget plan (``m`` as ``budgeted`` gave it) may still win once repaired:
    handing its units or regions back to f32 does not make it faster, so one that already ran
    slower than the fastest plan timed within budget (``fastest_s``) is left as it is, and its
    repair's probes (16 end-to-end runs, then up to ``MAX_UNIT_STEPS`` variants) are saved."""
    return overran(m) and (m.best_s is None or m.best_s < fastest_s)


def _in_f32(s: SessionView, region: Region) -> Region:
    f32 = replace(region, scope=replace(region.scope, precision=None))
    return replace(f32, cost_s=s.stored_cost(f32))


def gain_s(s: SessionView, region: Region) -> float:
    """What a bf16 or int8 region saves over the same region in f32 (0 when either was not
    measured)."""
    reduced, f32 = s.stored_cost(region), s.stored_cost(_in_f32(s, region))
    return f32 - reduced if reduced is not None and f32 is not None else 0.0


def sensitivity(s: SessionView, plan: Plan, index: int) -> float | None:
    """The error of ``plan``'s region ``index`` alone (by ``probe_metric``): the plan with that
    region as it is and every other in f32, measured end to end (None where that failed)."""
    regions = tuple(r if i == index else _in_f32(s, r) for i, r in enumerate(plan.regions))
    alone = replace(plan, regions=regions, notes={**plan.notes, "kind": "sensitivity"})
    m = s.measure(alone, f"sensitivity of region {index}", metric=probe_metric(s.options.metric))
    return m.rel_error if m is not None else None


def revert_order(gains: dict[int, float], errors: dict[int, float | None]) -> list[int]:
    """The reduced regions in the order they go back to f32: least speed lost per unit of error
    first (a region whose error is unknown goes last among equals; one with no error at all
    costs speed for nothing, so it goes last)."""

    def speed_per_error(i: int) -> float:
        err = errors.get(i)
        if err is None:
            return float("inf")
        return gains[i] / err if err > 0 else float("inf")

    return sorted(gains, key=lambda i: (speed_per_error(i), gains[i]))


def int8_units_of(s: SessionView, plan: Plan) -> list[int]:
    """The matmuls and convolutions (node indices) ``plan``'s int8 regions quantize, and the
    attention matmuls whose operands its OpenVINO-placed regions quantize where they are made
    (``attention_operands``; one whose matmul lies outside the region is not offered): each a
    unit the plan may keep in f32. Without the attention matmuls, every "unit alone" variant
    kept attention in int8: on MobileViT-style, each of 64 such variants measured at least
    1.0e-2, the budget; with them, 2e-4 to 6e-2."""
    kept = set(plan.calibration.f32_units) if plan.calibration is not None else set()
    bindings = main_bindings(s.mod["main"])
    operands = attention_operands(bindings)  # each attention source, with the matmul it feeds
    units: set[int] = set()
    for r in plan.regions:
        if r.scope.compute_precision != "int8":
            continue
        units |= {n for n in r.nodes if quantizes(bindings[n].value)}
        if registry.get(r.scope.backend).int8_placement == INPUTS:
            nodes = set(r.nodes)
            units |= {m for i, m in operands.items() if i in nodes and m in nodes}
    return sorted(units - kept)


def keeping_f32(plan: Plan, units: list[int]) -> Plan:
    """``plan`` with ``units`` (and those it kept already) left in f32 inside its int8 regions."""
    assert plan.calibration is not None
    kept = tuple(sorted(set(plan.calibration.f32_units) | set(units)))
    return replace(
        plan,
        calibration=replace(plan.calibration, f32_units=kept),
        notes={**plan.notes, "kind": "collage dp, within budget"},
    )


def unit_noises(s: SessionView, plan: Plan, units: list[int]) -> dict[int, float]:
    """Each of ``units``' noise in int8 (``partune.core.unit_noise``) on the model's values over
    ``plan``'s ranges; a unit whose values or ranges are unknown is left out."""
    if s.values is None:
        s.values = s.capture()
    values, ranges = s.values, plan.calibration.ranges if plan.calibration else {}
    func = s.mod["main"]
    bindings, names = main_bindings(func), calibrated_tensors(func)
    ends = int8_units(bindings)
    noise: dict[int, float] = {}
    for u in (u for u in units if u in ends):  # not an attention matmul
        value = bindings[u].value
        x, y = value.args[0], bindings[ends[u]].var
        x_range, y_range = ranges.get(names.get(x, "")), ranges.get(names.get(y, ""))
        if isinstance(values.get(x), np.ndarray) and x_range is not None:
            out = values.get(y) if y_range is not None else None
            noise[u] = unit_noise(value, values[x], x_range, out, y_range)
    return noise


def units_to_revert(order: list[int], drops: dict[int, float], need: float) -> int:
    """How many of ``order``'s first units go back to f32 for their ``drops`` to add up to
    ``need`` (all of them where they never do)."""
    removed = 0.0
    for k, u in enumerate(order):
        if removed >= need:
            return k
        removed += drops[u]
    return len(order)


def unit_drops(s: SessionView, plan: Plan, units: list[int], whole: float, scale: NoiseScale):
    """What ``plan``'s noise (``whole`` with every unit in int8) drops by when each unit alone
    goes back to f32, in the probes' metric: measured for the ``MAX_UNIT_PROBES`` units of most
    estimated noise (``unit_noises``), those whose noise the model most likely carries to its
    outputs."""
    noise = unit_noises(s, plan, units)
    probed = sorted(units, key=lambda u: -noise.get(u, 0.0))[:MAX_UNIT_PROBES]
    s.progress.start_phase("measure int8 units' shares of the error", len(probed))
    drops: dict[int, float] = {}
    probe = probe_metric(s.options.metric)
    for u in probed:
        m = s.measure(keeping_f32(plan, [u]), f"sensitivity of unit {u}", metric=probe)
        if m is not None and m.rel_error is not None:
            drops[u] = whole - scale.noise(m.rel_error, probed=True)
    return drops


def alone_noises(
    s: SessionView, plan: Plan, units: list[int], scale: NoiseScale
) -> dict[int, float]:
    """Each unit's noise with it alone in int8 and every other of ``units`` in f32, in the probes'
    metric: measured for the ``MAX_ALONE_PROBES`` units of most FLOPs (what int8 could save)."""
    flops = {u: float(s.graph.nodes[u].flops) for u in units}
    probed = sorted(units, key=lambda u: -flops[u])[:MAX_ALONE_PROBES]
    s.progress.start_phase("measure int8 units' errors alone", len(probed))
    probe, noises = probe_metric(s.options.metric), {}
    for u in probed:
        others = [v for v in units if v != u]
        m = s.measure(keeping_f32(plan, others), f"int8 unit {u} alone", metric=probe)
        if m is not None and m.rel_error is not None:
            noises[u] = scale.noise(m.rel_error, probed=True)
    return noises


def units_within(order: list[int], noises: dict[int, float], allowed: float) -> list[int]:
    """The units of ``order`` (best first) taken while their noises add up to at most
    ``allowed``; one that does not fit is passed over for the next (a greedy knapsack)."""
    chosen, total = [], 0.0
    for u in order:
        if total + noises[u] <= allowed:
            chosen.append(u)
            total += noises[u]
    return chosen


def build_up_units(
    s: SessionView, plan: Plan, label: str, units: list[int], scale: NoiseScale
) -> str | None:
    """Variants of an over-budget int8 ``plan`` that keep only some of its units in int8, for a
    plan whose noise must nearly all go: each unit's noise alone (``alone_noises``), the units
    of most FLOPs per unit of noise taken while their noises add up to ``AIM`` of the budget
    (noises of independent units add), each measured; the label of the first within budget. A
    variant over budget scales the next one's allowance by what it measured against what its
    units promised, up to ``MAX_UNIT_STEPS`` variants."""
    noises = alone_noises(s, plan, units, scale)
    flops = {u: float(s.graph.nodes[u].flops) for u in noises}
    order = sorted(noises, key=lambda u: -flops[u] / noises[u] if noises[u] > 0 else -np.inf)
    allowed = scale.noise(AIM * s.options.accuracy_budget)
    last: list[int] = []
    for _ in range(MAX_UNIT_STEPS):
        chosen = units_within(order, noises, allowed)
        if last and set(chosen) >= set(last):
            chosen = last[:-1]  # the allowance did not shrink the set: give up its last unit
        if not chosen:
            return None
        last = chosen
        name = f"{label} (int8 in {len(chosen)} of {len(units)} units)"
        variant = keeping_f32(plan, [u for u in units if u not in chosen])
        if not s.offer(name, variant):
            continue
        m = s.end_to_end(name, variant)
        if m.ok:
            return name
        if m.rel_error is None:
            return None
        # Over budget, so its error is above a tolerance above 0 (``tune`` refuses others).
        allowed *= sum(noises[u] for u in chosen) / scale.noise(m.rel_error)
    return None


def repair_units(s: SessionView, plan: Plan, label: str, error: float) -> str | None:
    """Variants of an over-budget int8 ``plan`` that keep some of its units in f32 inside the
    same regions (no new borders), each measured; the label of the first within budget.

    A unit's share of the error is what the plan's noise drops by when it alone stays in f32
    (``unit_drops``, ``NoiseScale``), and units go back in order of FLOPs given up per unit of
    noise removed (``revert_order``; NNCF's accuracy control reverts by sensitivity alone). The
    first variant hands back what the shares say brings the error to ``AIM`` of the budget; each
    one measured rescales the shares by what it removed against what they promised, up to
    ``MAX_UNIT_STEPS`` variants. Under top-1 agreement the shares are read in relative error
    (``probe_metric``), one more run of the whole plan giving the rate between the two."""
    units = int8_units_of(s, plan)
    if plan.calibration is None or not units:
        return None
    probe = probe_metric(s.options.metric)
    scale = NoiseScale.of(probe)
    if probe != s.options.metric:
        m = s.measure(plan, f"{label} ({probe} error)", metric=probe)
        if m is None or not m.rel_error:
            return None
        scale = NoiseScale.of(probe, per=error / m.rel_error)
    whole = scale.noise(error)
    if scale.noise(AIM * s.options.accuracy_budget) < BUILD_UP_BELOW * whole:
        return build_up_units(s, plan, label, units, scale)
    drops = {u: d for u, d in unit_drops(s, plan, units, whole, scale).items() if d > 0}
    order = revert_order({u: float(s.graph.nodes[u].flops) for u in drops}, drops)
    need = whole - scale.noise(AIM * s.options.accuracy_budget)
    rate, kept = 1.0, 0  # noise each variant removed per unit the shares promised
    for _ in range(MAX_UNIT_STEPS):
        k = max(units_to_revert(order, drops, need / rate), kept + 1)
        if k > len(order):
            return None
        kept = k
        name = f"{label} (int8, {k} unit{'s' if k > 1 else ''} in f32)"
        variant = keeping_f32(plan, order[:k])
        if not s.offer(name, variant):
            continue
        m = s.end_to_end(name, variant)
        if m.ok:
            return name
        if m.rel_error is None:
            return None
        removed = whole - scale.noise(m.rel_error)
        promised = sum(drops[u] for u in order[:k])
        rate = max(removed, 0.0) / promised if promised > 0 else rate
        if rate <= 0:
            return None
    return None


def repair(s: SessionView, plan: Plan, label: str) -> str | None:
    """Variants of an over-budget ``plan`` with bf16 and int8 regions handed back to f32, those
    that cost least speed per unit of error first (``revert_order``; each region's error alone,
    its ``sensitivity``, measured when the plan has at most ``MAX_SENSITIVITIES`` of them, else
    the least gainful first), each measured; the label of the first within budget (None if
    none)."""
    measured = s.result.end_to_end.get(label)
    if measured is not None and measured.rel_error is not None:
        found = repair_units(s, plan, label, measured.rel_error)
        if found is not None:
            return found
    reduced = [i for i, r in enumerate(plan.regions) if r.scope.compute_precision != "f32"]
    if not reduced:
        return None
    gains = {i: gain_s(s, plan.regions[i]) for i in reduced}
    errors = (
        {i: sensitivity(s, plan, i) for i in reduced}
        if 1 < len(reduced) <= MAX_SENSITIVITIES
        else {i: 1.0 for i in reduced}
    )
    order = revert_order(gains, errors)
    names = "/".join(p for p in plan.precisions if p != "f32")
    # Hand back one region at a time, then (if still over) every region at once.
    steps = [order[: k + 1] for k in range(min(MAX_REPAIRS, len(order) - 1))] + [order]
    for step, back in enumerate(steps, start=1):
        regions = tuple(_in_f32(s, r) if i in back else r for i, r in enumerate(plan.regions))
        variant = replace(
            plan, regions=regions, notes={**plan.notes, "kind": "collage dp, within budget"}
        )
        name = f"{label} ({names} within budget {step})"
        if not s.offer(name, variant):
            continue
        m = s.end_to_end(name, variant)
        if m.ok or not has_reduced(variant):
            return name
    return None
