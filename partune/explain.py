"""Why each region of a plan went where it went: the facts behind a placement, read, never measured.

Partune measures every alternative, yet a plan lists only the winners. For each region of
an emitted plan, ``explain`` gathers what every backend on offer did with exactly those
nodes (refused an op, failed, or ran slower, and by how much), the border costs the DP
charged, and how the plan stood against the peers. It reads the measurement store and
asks the backends what they accept (``partune.explain_evidence``); nothing here builds or times
anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from partune.core import (
    DataflowGraph,
    Plan,
    Region,
    SEScope,
    candidate_key,
    clean_error,
    contiguous_runs,
    fit_table,
    op_counts,
    op_summary,
    scope_name,
    short_op,
)
from partune.explain_evidence import Evidence

# Chosen, or why not: what a backend did with exactly a region's nodes.
CHOSEN, MEASURED, FAILED, REFUSED, UNPROPOSED, UNMEASURED = (
    "chosen",
    "measured",
    "failed",
    "not accepted",
    "not a candidate",
    "not measured",
)
_BORDER = re.compile(
    r"([-\d.e+]+) us per region \+ ([-\d.e+]+) ns per border byte \+ ([-\d.e+]+) ns per "
    r"weight byte \(fitted on (\d+) plans\)"
)  # BorderModel.describe
# Below a microsecond in a model (native TVM runs small regions inline, nearly free), a ratio
# to the winner means nothing: margins are then given in time only.
RATIO_FLOOR_S = 1e-6


@dataclass(frozen=True)
class CandidateFact:
    """One backend on one region's exact nodes."""

    backend: str
    status: str  # CHOSEN, MEASURED, FAILED, REFUSED, UNPROPOSED or UNMEASURED
    reason: str  # for people: why it won or lost
    source: str | None = None  # "measured" (the store keeps no cost-model predictions)
    best_s: float | None = None  # fastest sample, timed alone: what the search compares
    median_s: float | None = None
    spread_s: float | None = None  # interquartile range of the samples
    in_model_s: float | None = None  # best_s plus the backend's per-call cost inside a model
    refused: dict[str, list[int]] = field(default_factory=dict)  # op -> nodes it does not accept
    error: str | None = None


@dataclass(frozen=True)
class RegionFact:
    index: int  # 1-based, in plan order
    nodes: tuple[int, ...]
    backend: str
    ops: str  # "matmul x2, add, gelu"
    op_counts: dict[str, int]
    plan_cost_s: float | None  # the cost the plan records for it
    border_s: float | None  # the border cost the DP charged it (fitted model)
    candidates: tuple[CandidateFact, ...]
    runner_up: str | None = None
    margin_s: float | None = None  # runner-up's in-model cost minus the winner's
    margin_ratio: float | None = None  # runner-up / winner (in model)
    note: str = ""  # e.g. no other backend could take it, and why


@dataclass(frozen=True)
class PeerFact:
    label: str
    kind: str  # "plan" (a finalist) or "peer"
    median_s: float | None
    plan_speedup: float | None  # peer median / emitted plan median: above 1, the plan is faster
    error: str | None = None
    emitted: bool = False


@dataclass(frozen=True)
class Explanation:
    model: str
    fingerprint: str
    source: str  # where the plan came from, in words
    chosen_as: str
    measured_s: float | None
    backends: tuple[str, ...]
    device: str
    adjust_s: dict[str, float]
    border_model: str | None
    border_total_s: float | None
    dp_label: str | None
    dp_estimate_s: float | None
    regions: tuple[RegionFact, ...]
    peers: tuple[PeerFact, ...]
    best_peer: str | None
    speedup_vs_best_peer: float | None
    notes: tuple[str, ...] = ()


# -- deciding what the facts say ----------------------------------------------------------


def border_coefficients(description: str | None) -> tuple[tuple[float, float, float], int] | None:
    """The fitted border model of a plan's notes (``BorderModel.describe``), in seconds."""
    m = _BORDER.search(description or "")
    if m is None:
        return None
    return (float(m.group(1)) * 1e-6, float(m.group(2)) * 1e-9, float(m.group(3)) * 1e-9), int(
        m.group(4)
    )


def _refused(
    graph: DataflowGraph, nodes: Sequence[int], accepted: frozenset[int]
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for n in nodes:
        if n not in accepted:
            out.setdefault(short_op(graph.nodes[n].op), []).append(n)
    return out


def _candidate(
    graph: DataflowGraph, nodes: tuple[int, ...], scope: SEScope, ev: Evidence
) -> CandidateFact:
    """What one backend did with exactly ``nodes``; the reason is filled in once the winner is
    known."""
    b = scope.backend or "?"
    name = scope_name(scope)
    key = candidate_key(graph, nodes, scope)
    m = ev.measured.get(ev.tuned.get(key, key))
    refused = _refused(graph, nodes, ev.accepted.get(b, frozenset()))
    if m is None:
        status = (
            REFUSED if refused else UNMEASURED if nodes in ev.proposed.get(b, ()) else UNPROPOSED
        )
        return CandidateFact(name, status, "", refused=refused)
    if not m.ok:
        return CandidateFact(
            name, FAILED, "", "measured", refused=refused, error=clean_error(m.error or "")
        )
    in_model = max(m.cost_s + ev.adjust_s.get(name, 0.0), 0.0)
    return CandidateFact(
        name, MEASURED, "", "measured", m.cost_s, m.median_s, m.spread_s, in_model, refused
    )


def _time(seconds: float | None) -> str:
    """12.3 us, 4.56 ms, 1.23 s: for people."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    a = abs(seconds)
    return (
        f"{seconds * 1e6:.1f} us"
        if a < 1e-3
        else f"{seconds * 1e3:.3f} ms"
        if a < 1.0
        else f"{seconds:.2f} s"
    )


def _refusal(refused: dict[str, list[int]], limit: int = 3) -> str:
    parts = [
        (
            f"{op} (node{'s' if len(ns) > 1 else ''} "
            f"{', '.join(map(str, ns[:4]))}{', ...' if len(ns) > 4 else ''})"
        )
        for op, ns in list(refused.items())[:limit]
    ]
    more = f" and {len(refused) - limit} more ops" if len(refused) > limit else ""
    return "does not accept " + ", ".join(parts) + more


def _reason(c: CandidateFact, winner: CandidateFact | None, ev: Evidence) -> str:
    """Why ``c`` did not take the region (``winner``: the chosen backend's measured fact)."""
    if c.status == REFUSED:
        return _refusal(c.refused)
    if c.status == FAILED:
        return f"failed: {c.error}"
    if c.status == UNMEASURED and c.backend in ev.autotuned:
        return "not tuned: the tuning budget went to regions the DP was likelier to use"
    if c.status == UNMEASURED:
        return (
            "a candidate, not measured "
            "(ranked out by the cost model, or the search ran out of time)"
        )
    if c.status == UNPROPOSED:
        return (
            "accepts every op, but its partition rule (fusion style "
            f"{ev.fusion.get(c.backend, '?')}) proposes no region of exactly these nodes"
        )
    if winner is None or winner.in_model_s is None or c.in_model_s is None:
        return "measured; the chosen backend has no time alone to compare with"
    delta = c.in_model_s - winner.in_model_s
    pct = f" ({delta / winner.in_model_s:+.0%})" if winner.in_model_s >= RATIO_FLOOR_S else ""
    if delta >= 0:
        return f"slower by {_time(delta)}{pct}"
    return f"faster alone by {_time(-delta)}{pct}: isolated times did not decide this region"


def _region(
    graph: DataflowGraph,
    index: int,
    region: Region,
    plan: Plan,
    ev: Evidence,
    border: tuple[float, float, float] | None,
) -> RegionFact:
    """Every backend on offer against one region of the plan, the winner first."""
    from partune.cost_models import region_features

    nodes = tuple(sorted(set(region.nodes)))
    scopes = [region.scope] + [
        s
        for s in plan.config.primitives  # (one-thread twins are never candidates)
        if (s.backend, s.precision) != (region.backend, region.scope.precision) and not s.threads
    ]
    facts = [_candidate(graph, nodes, s, ev) for s in scopes]
    winner = facts[0] if facts[0].status == MEASURED else None
    others = sorted(
        (f for f in facts[1:] if f.status == MEASURED), key=lambda f: f.in_model_s or 0.0
    )
    rest = [f for f in facts[1:] if f.status != MEASURED]
    runner = others[0] if others else None
    margin = ratio = None
    if (
        winner is not None
        and runner is not None
        and winner.in_model_s is not None
        and runner.in_model_s is not None
    ):
        margin = runner.in_model_s - winner.in_model_s
        ratio = (
            runner.in_model_s / winner.in_model_s if winner.in_model_s >= RATIO_FLOOR_S else None
        )
    head = _winner(facts[0], runner, margin, plan)
    out = [head] + [_with_reason(f, winner, ev) for f in others + rest]
    note = ""
    if not others:
        why = (
            "; ".join(f"{f.backend} {_reason(f, winner, ev)}" for f in rest)
            or "no other backend was offered"
        )
        only = all(f.status == REFUSED for f in rest) and rest
        note = (
            f"only {region.backend} takes these nodes: "
            if only
            else "no other backend was measured on exactly these nodes: "
        ) + why
    extra = (
        float(sum(c * f for c, f in zip(border, region_features(graph, nodes), strict=True)))
        if border
        else None
    )
    return RegionFact(
        index,
        nodes,
        region.backend,
        op_summary(graph, nodes),
        op_counts(graph, nodes),
        region.cost_s,
        extra,
        tuple(out),
        runner.backend if runner else None,
        margin,
        ratio,
        note,
    )


def _with_reason(f: CandidateFact, winner: CandidateFact | None, ev: Evidence) -> CandidateFact:
    return CandidateFact(**{**asdict(f), "reason": _reason(f, winner, ev)})


def _winner(
    f: CandidateFact, runner: CandidateFact | None, margin: float | None, plan: Plan
) -> CandidateFact:
    """The chosen backend's row: by how much it won, or why it has no time of its own."""
    if plan.model_file is not None:
        reason = f"{plan.model_file.describe()}, measured end to end against the partitioned plans"
    elif f.status != MEASURED:
        reason = (
            f"not measured alone ({f.status}): the region comes from a plan measured end to end "
            f"('{plan.notes.get('chosen_as', '?')}')"
        )
    elif runner is None:
        reason = "chosen; no other backend has a time for these nodes"
    elif margin is not None and margin >= 0:
        reason = f"chosen; {_time(margin)} ahead of {runner.backend}"
    else:
        won = plan.notes.get("chosen_as")
        reason = f"chosen, though {runner.backend} is faster alone" + (
            f": the plan '{won}' won measured end to end (border costs, fusion across regions)"
            if won
            else ""
        )
    return CandidateFact(**{**asdict(f), "status": CHOSEN, "reason": reason})


def _peers(notes: Mapping[str, Any]) -> tuple[PeerFact, ...]:
    """The verdict (interleaved medians): every finalist and peer against the emitted plan."""
    medians: dict[str, float] = dict(notes.get("verdict_median_s") or {})
    chosen = notes.get("chosen_as")
    own = medians.get(chosen) if chosen else None
    peers = set(notes.get("peers") or ())
    out = []
    for label, median in sorted(medians.items(), key=lambda kv: kv[1]):
        speedup = median / own if own and label != chosen else None
        out.append(
            PeerFact(
                label,
                "peer" if label in peers else "plan",
                median,
                speedup,
                emitted=label == chosen,
            )
        )
    for label, error in (notes.get("peers_unavailable") or {}).items():
        out.append(PeerFact(label, "peer", None, None, clean_error(str(error))))
    return tuple(out)


def explain(plan: Plan, graph: DataflowGraph, ev: Evidence, source: str) -> Explanation:
    """The facts behind every region of ``plan`` (a plan for ``graph``)."""
    notes = plan.notes
    fitted = border_coefficients(notes.get("border_model"))
    coef = fitted[0] if fitted else None
    regions = tuple(_region(graph, i, r, plan, ev, coef) for i, r in enumerate(plan.regions, 1))
    said = []
    if plan.model_file is not None:
        best = notes.get("best_partitioned")
        said.append(
            f"no partitioned plan beat {notes.get('chosen_as')}: the plan runs "
            f"{plan.model_file.describe()}, unpartitioned"
            + (
                f"; the best partitioned plan, '{best}', ran "
                f"{_time(notes.get('best_partitioned_median_s'))}"
                if best
                else ""
            )
        )
    if not ev.measured:
        said.append(
            f"the storage holds no measurements of device {ev.device}: only what the backends "
            "accept is shown"
        )
    # A model-file plan is not the DP's: the border costs it charged apply to the partitioned plans.
    border_total = (
        sum(r.border_s or 0.0 for r in regions) if coef and plan.model_file is None else None
    )
    return Explanation(
        plan.model,
        plan.fingerprint,
        source,
        str(notes.get("chosen_as", notes.get("kind", "?"))),
        notes.get("measured_s"),
        plan.config.backends,
        ev.device,
        dict(ev.adjust_s),
        notes.get("border_model"),
        border_total,
        notes.get("dp_label"),
        notes.get("dp_estimate_s"),
        regions,
        _peers(notes),
        notes.get("best_peer"),
        notes.get("speedup_vs_best_peer"),
        tuple(said),
    )


# -- showing ------------------------------------------------------------------------------


def node_ranges(nodes: Sequence[int]) -> str:
    """0-5, 9, 12-14."""
    return ", ".join(
        f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in contiguous_runs(list(nodes))
    )


def to_json(e: Explanation) -> dict[str, Any]:
    """The explanation as JSON-able data (no NaN or infinity: unknown is null)."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return clean(asdict(e))


def _header(e: Explanation) -> list[str]:
    measured = f", {_time(e.measured_s)} measured end to end" if e.measured_s else ""
    lines = [
        f"{e.model} (fingerprint {e.fingerprint}): plan '{e.chosen_as}' from {e.source}, "
        f"{len(e.regions)} region(s){measured}",
        f"backends on offer: {', '.join(e.backends)}; measurements of device {e.device or '-'}; "
        "every time shown was measured (the store keeps no cost-model predictions)",
    ]
    if e.adjust_s:
        lines.append(
            "'in model' = the fastest sample timed alone + the backend's per-call cost inside a "
            "model: " + ", ".join(f"{b} {v * 1e6:+.1f} us" for b, v in e.adjust_s.items())
        )
    if e.border_model and e.border_total_s is not None:
        lines.append(
            f"border costs the DP charged this plan: {_time(e.border_total_s)} in all, at "
            f"{e.border_model}"
        )
    elif e.border_model:
        lines.append(f"border costs the DP learned: {e.border_model}")
    if e.dp_label and e.dp_estimate_s:
        lines.append(f"DP estimate of '{e.dp_label}': {_time(e.dp_estimate_s)}")
    return lines + [f"note: {n}" for n in e.notes]


def _region_lines(r: RegionFact, total: int) -> list[str]:
    nodes = (
        f"node {r.nodes[0]}"
        if len(r.nodes) == 1
        else f"nodes {node_ranges(r.nodes)} ({len(r.nodes)})"
    )
    lines = ["", f"region {r.index}/{total}: {r.backend}, {nodes}: {r.ops}"]
    said = []
    if r.margin_s is not None and r.runner_up and r.margin_s >= 0:
        ratio = f" ({r.margin_ratio:.2f}x)" if r.margin_ratio else ""
        said.append(f"margin over the runner-up, {r.runner_up}: {_time(r.margin_s)}{ratio}")
    elif r.margin_s is not None and r.runner_up:
        said.append(f"the runner-up, {r.runner_up}, is {_time(-r.margin_s)} faster alone")
    if r.border_s is not None:
        said.append(f"border cost {_time(r.border_s)}")
    if said:
        lines.append("  " + "; ".join(said))
    if r.note:
        lines.append(f"  {r.note}")
    rows = [
        [
            c.backend,
            _time(c.best_s),
            _time(c.median_s),
            _time(c.spread_s),
            _time(c.in_model_s),
            c.reason,
        ]
        for c in r.candidates
    ]
    lines += [
        "  " + ln
        for ln in fit_table(
            ("backend", "alone", "median", "spread", "in model", "why"), rows, "<>>>><"
        )
    ]
    return lines


def _peer_lines(e: Explanation) -> list[str]:
    if not e.peers:
        return []
    rows = []
    for p in e.peers:
        name = p.label + (" (emitted)" if p.emitted else "")
        if p.error is not None:
            rows.append([name, p.kind, "-", f"unavailable: {p.error}"])
        else:
            stand = (
                "-"
                if p.plan_speedup is None
                else (
                    f"{p.plan_speedup:.2f}x as fast"
                    if p.plan_speedup >= 1
                    else f"at {p.plan_speedup:.2f}x its speed"
                )
            )
            rows.append([name, p.kind, _time(p.median_s), stand])
    lines = ["", "the finalists and the peers, timed in interleaved rounds (medians):"]
    lines += [
        "  " + ln for ln in fit_table(("contender", "kind", "median", "the plan is"), rows, "<<><")
    ]
    if e.best_peer == e.chosen_as:
        lines.append(
            f"the plan is the best peer, {e.best_peer}, itself: no partitioned plan beat it"
        )
    elif e.best_peer and e.speedup_vs_best_peer:
        lines.append(
            f"best peer: {e.best_peer}; the plan runs at {e.speedup_vs_best_peer:.2f}x its speed"
        )
    elif not any(p.kind == "peer" for p in e.peers):
        lines.append("no peer was timed (tune --peers none)")
    return lines


def render_text(e: Explanation) -> str:
    """The explanation as a terminal page: a header, one table per region, the peers."""
    lines = _header(e)
    for r in e.regions:
        lines += _region_lines(r, len(e.regions))
    return "\n".join(lines + _peer_lines(e))
