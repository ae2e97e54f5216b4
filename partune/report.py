"""``partune report``: a tuning job as a page a person can read — Markdown and PNG plots.

Everything comes from the storage (the study's best plan and its notes, the refinement
study's trials, the measurements of every candidate) plus the model itself for the graph
picture and the partition as ONNX (for Netron); nothing is measured here. The page opens
with what to try next, derived from those numbers (``report_regions.next_steps``).
"""

from __future__ import annotations

from pathlib import Path

import optuna

from partune.core import Plan, candidate_key, region_label
from partune.partition_onnx import write_partition_onnx
from partune.report_graph import COLOURS, draw_graph
from partune.report_graph import colour as _colour
from partune.report_regions import (
    SHOWN,
    RegionTime,
    facts,
    next_steps,
    plot_region_times,
    region_times,
    stored_measurements,
)
from partune.store import MEMORY


def plot_history(end_to_end_s: dict[str, float], refine_values: list[float], path: Path) -> None:
    """Plans measured end to end (bars), and the refinement's trials with their best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, 2 if refine_values else 1, figsize=(12 if refine_values else 7, 4), squeeze=False
    )
    labels = sorted(end_to_end_s, key=end_to_end_s.get)
    ax = axes[0][0]
    ax.barh(labels, [end_to_end_s[k] * 1e3 for k in labels], color="#4c72b0")
    ax.invert_yaxis()
    ax.set_xlabel("ms (best sample, end to end)")
    ax.set_title("plans measured end to end")
    if refine_values:
        ax = axes[0][1]
        xs = list(range(len(refine_values)))
        ax.plot(xs, [v * 1e3 for v in refine_values], "o", color="#999999", label="trial")
        best, run = [], float("inf")
        for v in refine_values:
            run = min(run, v)
            best.append(run * 1e3)
        ax.plot(xs, best, "-", color="#c44e52", label="best so far")
        ax.set_xlabel("refinement trial")
        ax.set_ylabel("ms")
        ax.set_title("Optuna refinement")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_shares(plan: Plan, path: Path) -> dict[str, tuple[int, float]]:
    """Per backend: nodes and share of the plan's measured region time; returns the numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, tuple[int, float]] = {}
    for r in plan.regions:
        n, t = rows.get(r.backend, (0, 0.0))
        rows[r.backend] = (n + len(r.nodes), t + (r.cost_s or 0.0))
    fig, ax = plt.subplots(figsize=(6, 3))
    names = sorted(rows)
    total = sum(t for _, t in rows.values()) or 1.0
    ax.bar(names, [rows[b][1] / total * 100 for b in names], color=[_colour(b) for b in names])
    ax.set_ylabel("% of region time")
    ax.set_title("where the time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return rows


def plot_pareto(points: list[tuple[float, float]], front: list[dict], path: Path) -> None:
    """Latency against peak memory: every refinement trial, and the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [t * 1e3 for t, _ in points], [m for _, m in points], "o", color="#999999", label="variant"
    )
    fx = [f["latency_s"] * 1e3 for f in front]
    fy = [f["peak_bytes"] / 2**20 for f in front]
    ax.step(fx, fy, "-o", where="post", color="#d62728", label="Pareto front")
    ax.set_xlabel("latency, ms (best sample)")
    ax.set_ylabel("peak memory, MiB")
    ax.set_title("Refinement: latency vs memory (NSGA-II)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _region_rows(storage: str, plan: Plan, model) -> tuple[list[RegionTime], list[str]]:
    """Per region its time and best alternative (from the store), and a label naming its ops."""
    if model is None:  # no graph: the plan's own costs, no alternatives
        return (
            [
                RegionTime(k, r.backend, len(r.nodes), r.cost_s, False)
                for k, r in enumerate(plan.regions)
            ],
            [f"r{k:02d} {r.backend}" for k, r in enumerate(plan.regions)],
        )
    graph = model.graph
    wanted = {candidate_key(graph, tuple(sorted(r.nodes)), r.scope) for r in plan.regions}
    rows = region_times(
        graph, plan, stored_measurements(storage, wanted) if storage != MEMORY else {}
    )
    labels = [f"r{k:02d} {region_label(graph, r.nodes, 32)}" for k, r in enumerate(plan.regions)]
    return rows, labels


def _region_lines(rows: list[RegionTime], labels: list[str]) -> list[str]:
    """The Markdown section of the region plot: the picture, then the slowest regions as a table."""
    lines = [
        "## Each region against its best alternative",
        "",
        "Isolated times (best sample) from the measurement store: the region on its backend, and "
        "the fastest other backend measured on the same nodes (exactly, or summed over measured "
        "runs of them).",
        "",
        "![regions](regions.png)",
        "",
    ]
    guessed = sum(not r.measured for r in rows)
    if guessed:
        lines += [
            f"{guessed} of {len(rows)} regions have no stored measurement: their time is the "
            "plan's cost (calibrated to the whole model), with no alternative.",
            "",
        ]
    lines += ["| region | backend | us | best alternative | us |", "|---|---|---|---|---|"]
    slowest = sorted(rows, key=lambda r: -(r.time_s or 0.0))[:SHOWN]
    for r in sorted(slowest, key=lambda r: r.index):
        t = f"{r.time_s * 1e6:.1f}" if r.time_s is not None else "?"
        alt = (
            f"{r.best.backend}{'' if r.best.exact else ' (cover)'} | {r.best.time_s * 1e6:.1f}"
            if r.best is not None
            else "none measured | "
        )
        lines.append(f"| {labels[r.index]} | {r.backend} | {t} | {alt} |")
    return lines + [""]


def _headline(study_name: str, plan: Plan) -> list[str]:
    """The emitted plan, how it stands against the best peer, and the DP's estimate."""
    notes = plan.notes
    lines = [f"# {plan.model}: tuning job '{study_name}'", ""]
    chosen = notes.get("chosen_as", "?")
    if plan.model_file is not None:
        lines.append(
            f"Emitted plan: **{chosen}**: no partitioned plan beat {plan.model_file.describe()}, "
            "so that is the plan "
            f"(the best partitioned one, '{notes.get('best_partitioned')}', was slower)."
        )
    else:
        lines.append(
            f"Emitted plan: **{chosen}**, {len(plan.regions)} regions over "
            f"{', '.join(plan.backends)}."
        )
    if "speedup_vs_best_peer" in notes and plan.model_file is None:
        x = notes["speedup_vs_best_peer"]
        lines.append(
            f"Against the best peer ({notes['best_peer']}): **{x:.2f}x** "
            f"({'faster' if x >= 1 else 'slower'}; medians of interleaved rounds in one process)."
        )
    if notes.get("dp_estimate_s") and notes.get("end_to_end_s", {}).get(notes.get("dp_label")):
        est, meas = notes["dp_estimate_s"], notes["end_to_end_s"][notes["dp_label"]]
        lines.append(
            f"DP estimate {est * 1e3:.3f} ms vs measured {meas * 1e3:.3f} ms "
            f"({est / meas - 1:+.0%}); {notes.get('border_model', '')}."
        )
    return lines


def _partition_lines(model, plan: Plan, out: Path) -> list[str]:
    """The graph picture and the partition as ONNX (for Netron), or why there is none."""
    if model is None:
        return []
    files = draw_graph(model.graph, plan, out)
    lines = ["## The partition", "", "![graph](graph.png)", ""]
    if any(f.suffix == ".svg" for f in files):
        lines += ["Zoomable: [graph.svg](graph.svg) (Graphviz source: graph.dot).", ""]
    written = write_partition_onnx(plan, model, out)
    if written.path is not None:
        lines += [
            f"[{written.path.name}]({written.path.name}): the model's graph as ONNX "
            f"({written.nodes} nodes), each named after its region (`r03_openvino/...`) and "
            "carrying `partune.backend`, `partune.region` and `partune.scope` as node metadata: "
            "open it in Netron.",
            "",
        ]
    else:
        lines += [f"No partition ONNX: {written.reason}.", ""]
    return lines


def write_report(
    storage: str,
    study_name: str,
    plan: Plan,
    out: Path,
    model=None,
    refine_study: str | None = None,
) -> Path:
    """Write ``out``/report.md and its PNGs for the job whose emitted plan is ``plan``
    (``refine_study``: the job's refinement study); returns the Markdown path."""
    notes = plan.notes
    out.mkdir(parents=True, exist_ok=True)
    trials = []
    if refine_study is not None:
        trials = [
            t
            for t in optuna.load_study(study_name=refine_study, storage=storage).trials
            if t.state == optuna.trial.TrialState.COMPLETE
            and all(v < float("inf") for v in t.values)
        ]
    plot_history(notes.get("end_to_end_s", {}), [t.values[0] for t in trials], out / "history.png")
    front = [f for f in notes.get("pareto_front", []) if f.get("peak_bytes") is not None]
    if front:
        plot_pareto(
            [(t.values[0], t.values[1]) for t in trials if len(t.values) > 1],
            front,
            out / "pareto.png",
        )
    shares = plot_shares(plan, out / "shares.png")
    rows, labels = _region_rows(storage, plan, model)
    plot_region_times(rows, labels, out / "regions.png", COLOURS)
    lines = _headline(study_name, plan)
    lines += ["", "## What to try next", "", " ".join(next_steps(facts(plan, rows)))]
    lines += [
        "",
        "## Finalists and peers (one process, interleaved)",
        "",
        "| contender | median ms |",
        "|---|---|",
    ]
    lines += [
        f"| {k} | {v * 1e3:.3f} |"
        for k, v in sorted(notes.get("verdict_median_s", {}).items(), key=lambda kv: kv[1])
    ]
    lines += ["", *_partition_lines(model, plan, out), *_region_lines(rows, labels)]
    lines += [
        "## Plans measured end to end",
        "",
        "![history](history.png)",
        "",
        "## Where the time goes",
        "",
        "| backend | nodes | region time |",
        "|---|---|---|",
    ]
    total = sum(t for _, t in shares.values()) or 1.0
    lines += [f"| {b} | {n} | {t / total:.1%} |" for b, (n, t) in sorted(shares.items())]
    lines += ["", "![shares](shares.png)", ""]
    if front:
        lines += [
            "## Latency vs peak memory (Pareto front)",
            "",
            "Each variant measured in a fresh process; memory is what the built plan keeps "
            "resident plus what its runs add.",
            "",
            "| plan file | best ms | peak MiB | backends |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| PLAN.front{i}.json | {f['latency_s'] * 1e3:.3f} | {f['peak_bytes'] / 2**20:.1f} | "
            f"{'+'.join(f['backends'])} |"
            for i, f in enumerate(front, 1)
        ]
        lines += ["", "![pareto](pareto.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
