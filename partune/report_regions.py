"""Each region of a plan against the best alternative measured for its nodes, and what to try next.

The search measured far more than the winner: every candidate it timed is in the
measurement store under ``candidate_key(graph, nodes, scope)``. For a region of the plan,
the alternatives are the other backends' measurements of the same nodes: the exact node
set, or a cover of it by measured runs of consecutive nodes. All times compared here are
isolated ones (best sample) from the store, so chosen and alternative are alike; a region
the store has no measurement of falls back to the plan's own ``cost_s``. From those rows
and the plan's notes, ``next_steps`` says in a sentence or two what would help, and only
what the numbers show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import optuna

from partune.backends import registry
from partune.core import DataflowGraph, Plan, SEScope, calibration_keys, candidate_key
from partune.runners import Measurement
from partune.search import anchor_kind, expected_speedup
from partune.store import STUDY_PREFIX, read_measurements

MAX_RUN = 24  # nodes: the longest run of consecutive nodes a cover tries as one candidate
COVER_UP_TO = 300  # nodes: larger regions are compared on their exact node set only
SHOWN = 40  # regions in the plot (the slowest)
MARGIN = 0.9  # an alternative (or tuned TVM's estimate) beats a region under this share of its time
MIN_SHARE = 0.02  # advice about tuning needs an estimated saving of this share of the regions' time
TUNED = ":tuned"  # a tuned measurement's key is the candidate's key plus this and its trials


@dataclass(frozen=True)
class Alternative:
    backend: str
    time_s: float
    exact: bool  # measured on exactly the region's nodes (else summed over a cover of runs)


@dataclass(frozen=True)
class RegionTime:
    """One region of the plan: its time, the best other backend, and tuned TVM's estimate."""

    index: int
    backend: str
    nodes: int
    time_s: float | None
    measured: bool  # time_s from the store (isolated, best sample); else the plan's cost_s
    best: Alternative | None = None
    tuned_estimate_s: float | None = None  # set when not tuned yet and it would beat time_s

    @property
    def beaten(self) -> bool:
        """A measured alternative ran faster in isolation (the plan took this one anyway)."""
        return (
            self.best is not None
            and self.time_s is not None
            and self.best.time_s < MARGIN * self.time_s
        )


def stored_measurements(storage: str, wanted: set[str]) -> dict[str, Measurement]:
    """The measurements of the device whose study holds most of ``wanted`` keys (the plan's
    regions), key -> measurement (the latest of a key wins, as in the store)."""
    best: dict[str, Measurement] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if not summary.study_name.startswith(STUDY_PREFIX):
            continue
        found = read_measurements(storage, summary.study_name)
        if not best or len(wanted & found.keys()) > len(wanted & best.keys()):
            best = found
    return best


class _Costs:
    """Isolated costs of node sets under scopes, from stored measurements (tuned ones too)."""

    def __init__(self, graph: DataflowGraph, measured: dict[str, Measurement]) -> None:
        self.graph, self.measured = graph, measured
        self.tuned: dict[str, float] = {}
        for key, m in measured.items():
            if TUNED in key and m.ok:
                base = key.split(TUNED)[0]
                self.tuned[base] = min(self.tuned.get(base, math.inf), m.cost_s)

    def key(self, nodes: tuple[int, ...], scope: SEScope) -> str:
        return candidate_key(self.graph, nodes, scope)

    def of(self, nodes: tuple[int, ...], scope: SEScope) -> float:
        key = self.key(nodes, scope)
        m = self.measured.get(key)
        return min(m.cost_s if m is not None else math.inf, self.tuned.get(key, math.inf))

    def cover(self, nodes: tuple[int, ...], scope: SEScope) -> float:
        """The cheapest cover of ``nodes`` (sorted) by measured runs of consecutive ones."""
        best = [0.0] + [math.inf] * len(nodes)
        for j in range(1, len(nodes) + 1):
            for i in range(max(0, j - MAX_RUN), j):
                if math.isfinite(best[i]):
                    best[j] = min(best[j], best[i] + self.of(nodes[i:j], scope))
        return best[-1]

    def untuned(self, nodes: tuple[int, ...], scope: SEScope) -> float | None:
        """The measured untuned time when these nodes were never tuned (else None)."""
        m = self.measured.get(self.key(nodes, scope))
        return (
            m.cost_s
            if m is not None and m.ok and self.key(nodes, scope) not in self.tuned
            else None
        )


def _autotuned(backend: str | None) -> bool:
    try:
        return backend is not None and registry.get(backend).autotuned
    except (
        registry.UnknownBackendError,
        ImportError,
    ):  # not one this installation has: not one to tune
        return False


def region_times(
    graph: DataflowGraph, plan: Plan, measured: dict[str, Measurement]
) -> list[RegionTime]:
    """Per region of ``plan``: its isolated time, the fastest other backend on its nodes, and
    (when TVM tuning never ran on them) tuned TVM's estimate if it would beat the region: the
    untuned time over the usual speed-up of its kind of op (as the search's tuning order
    estimates it), except the cost of an empty call, which no schedule speeds up."""
    costs = _Costs(graph, measured)
    native = plan.config.default
    call = measured.get(calibration_keys(native)[0])  # an empty call: what no schedule speeds up
    floor = call.cost_s if call is not None and call.ok else 0.0
    rows = []
    for k, r in enumerate(plan.regions):
        nodes = tuple(sorted(r.nodes))
        own = costs.of(nodes, r.scope)
        time_s, from_store = (own, True) if math.isfinite(own) else (r.cost_s, False)
        best = None
        for s in plan.config.primitives:
            if s == r.scope:
                continue
            exact = costs.of(nodes, s)
            t = exact if math.isfinite(exact) or len(nodes) > COVER_UP_TO else costs.cover(nodes, s)
            if math.isfinite(t) and (best is None or t < best.time_s):
                best = Alternative(s.backend or str(s), t, math.isfinite(exact))
        estimate = None
        untuned = costs.untuned(nodes, native) if not _autotuned(r.backend) else None
        if untuned is not None and not any(
            costs.key(nodes, s) in costs.tuned for s in plan.config.primitives
        ):
            guess = floor + max(untuned - floor, 0.0) / expected_speedup(anchor_kind(graph, nodes))
            estimate = guess if time_s is not None and guess < MARGIN * time_s else None
        rows.append(RegionTime(k, r.backend, len(nodes), time_s, from_store, best, estimate))
    return rows


@dataclass(frozen=True)
class Facts:
    """What the advice is derived from (``facts``): counts and ratios, no prose."""

    regions: int = 0
    compared: int = 0  # regions whose time came from the store, so alternatives could be looked up
    would_win_tuned: int = 0  # regions tuned TVM would take if tuning brings its usual speed-up
    tuned_saving_s: float = 0.0  # what those regions would save together, estimated
    regions_s: float = 0.0  # all regions' isolated times together (the same footing as the saving)
    tuning_offered: bool = False  # the search had an autotuned backend (--tune-budget)
    beaten: int = 0  # regions a measured alternative beat in isolation
    model_file: str | None = None  # the plan is the model's own file under this library
    partitioned_slower: float | None = None  # the best partitioned plan's median over the file's
    best_peer: str | None = None
    speedup_vs_best_peer: float | None = None  # > 1: the plan is faster
    random_inputs: str | None = None  # why candidates were measured on random inputs, if they were


def facts(plan: Plan, rows: list[RegionTime]) -> Facts:
    notes = plan.notes
    slower = None
    if plan.model_file is not None:
        file_s = notes.get("verdict_median_s", {}).get(notes.get("chosen_as"))
        part_s = notes.get("best_partitioned_median_s")
        slower = part_s / file_s if file_s and part_s else None
    inputs = str(notes.get("inputs_from", "model"))
    return Facts(
        regions=len(rows),
        compared=sum(r.measured for r in rows),
        would_win_tuned=sum(r.tuned_estimate_s is not None for r in rows),
        tuning_offered=any(_autotuned(b) for b in plan.config.backends),
        beaten=sum(r.beaten for r in rows),
        model_file=plan.model_file.library if plan.model_file else None,
        partitioned_slower=slower,
        best_peer=notes.get("best_peer"),
        speedup_vs_best_peer=notes.get("speedup_vs_best_peer"),
        tuned_saving_s=sum(
            r.time_s - r.tuned_estimate_s
            for r in rows
            if r.tuned_estimate_s is not None and r.time_s is not None
        ),
        regions_s=sum(r.time_s for r in rows if r.time_s is not None),
        random_inputs=(inputs.removeprefix("random").strip(" ()") or "no reason given")
        if inputs.startswith("random")
        else None,
    )


def _us(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _regions(n: int) -> str:
    return f"{n} region{'s' if n != 1 else ''}"


def next_steps(f: Facts) -> list[str]:
    """At most two plain sentences on what to try next, each backed by ``f``, most useful first."""
    out = []
    if f.model_file is not None:
        by = (
            f" (the best partitioned one was {f.partitioned_slower:.2f}x slower)"
            if f.partitioned_slower
            else ""
        )
        out.append(
            f"The plan is the model's own file under {f.model_file}: no partitioned mix beat "
            f"it{by}."
        )
    if f.random_inputs is not None:
        out.append(
            f"Candidates were measured on random inputs ({f.random_inputs}); times of "
            "data-dependent ops may differ on real data."
        )
    if f.would_win_tuned and f.tuned_saving_s >= MIN_SHARE * f.regions_s:
        of = f" of the regions' {_us(f.regions_s)}, timed alone" if f.regions_s else ""
        how = (
            "raise --tune-budget"
            if f.tuning_offered
            else "set --tune-budget (it adds the tvm-tuned backend)"
        )
        out.append(
            f"{how[0].upper()}{how[1:]}: {_regions(f.would_win_tuned)} would run faster under "
            f"tuned TVM if tuning brings its usual speed-up (about {_us(f.tuned_saving_s)} "
            f"saved{of})."
        )
    if (
        f.speedup_vs_best_peer is not None
        and f.speedup_vs_best_peer < 1
        and f.best_peer
        and f.model_file is None
    ):
        out.append(
            f"{f.best_peer} runs this model {1 / f.speedup_vs_best_peer:.2f}x faster than the "
            "plan: use it for this model."
        )
    if f.beaten:
        out.append(
            f"{_regions(f.beaten)} of {f.regions} had an alternative that measured faster alone; "
            "the whole-plan measurements chose otherwise, and more --refine-trials try other "
            "mixes."
        )
    if not out and not f.compared:
        out.append(
            "No region could be held against its alternatives: the measurement store has none of "
            "the plan's regions (or the model could not be loaded)."
        )
    if not out:
        vs = (
            f"; the plan runs {f.speedup_vs_best_peer:.2f}x as fast as {f.best_peer}"
            if f.speedup_vs_best_peer is not None and f.best_peer
            else ""
        )
        out.append(
            f"Nothing measured points to an easy gain: no other backend ran any region's nodes "
            f"in under {MARGIN:.0%} of its time{vs}."
        )
    return out[:2]


def plot_region_times(
    rows: list[RegionTime], labels: list[str], path: Path, colours: dict[str, str]
) -> None:
    """Per region (the ``SHOWN`` slowest): its time on its backend, beside the best alternative
    measured for the same nodes and, where it would win, tuned TVM's estimate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = sorted((r for r in rows if r.time_s is not None), key=lambda r: -(r.time_s or 0.0))[
        :SHOWN
    ]
    shown.sort(key=lambda r: r.index)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * max(len(shown), 1)))
    ys = list(range(len(shown)))
    grey = "#bbbbbb"
    ax.barh(
        [y - 0.2 for y in ys],
        [r.time_s * 1e6 for r in shown],
        height=0.38,
        color=[colours.get(r.backend, grey) for r in shown],
    )
    alt = [(y, r.best) for y, r in zip(ys, shown, strict=True) if r.best is not None]
    ax.barh(
        [y + 0.2 for y, _ in alt],
        [a.time_s * 1e6 for _, a in alt],
        height=0.38,
        color=[colours.get(a.backend, grey) for _, a in alt],
        alpha=0.45,
        hatch="//",
        edgecolor="white",
    )
    est = [
        (y, r.tuned_estimate_s)
        for y, r in zip(ys, shown, strict=True)
        if r.tuned_estimate_s is not None
    ]
    if est:
        ax.plot([e * 1e6 for _, e in est], [y for y, _ in est], "k*", label="tuned TVM, estimated")
    ax.set_yticks(ys, [labels[r.index] for r in shown], fontsize=7)
    ax.invert_yaxis()
    times = [r.time_s for r in shown] + [a.time_s for _, a in alt]
    if times and max(times) / max(min(times), 1e-12) > 100:
        ax.set_xscale("log")
    ax.set_xlabel("us per call (isolated, best sample)")
    title = "each region (solid) vs the best other backend measured on its nodes (hatched)"
    if len(shown) < len(rows):
        title += f": the {len(shown)} slowest of {len(rows)}"
    ax.set_title(title, fontsize=9)
    used = sorted({r.backend for r in shown} | {a.backend for _, a in alt})
    handles = [Patch(color=colours.get(b, grey), label=b) for b in used]
    if est:
        handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
