"""``partune report``: a tuning job as a page a person can read — Markdown and PNG plots.

Everything comes from the storage (the study's best plan and its notes, the refinement
study's trials) plus the model itself for the graph picture; nothing is measured here.
"""

from __future__ import annotations

from pathlib import Path

import optuna

from partune.core.graph import DataflowGraph
from partune.core.plan import Plan

COLOURS = {"tvm": "#4c72b0", "torch": "#dd8452", "onnxruntime": "#55a868", "openvino": "#c44e52"}


def _colour(backend: str) -> str:
    return COLOURS.get(backend, "#8172b3")


def plot_history(end_to_end_s: dict[str, float], refine_values: list[float], path: Path) -> None:
    """Plans measured end to end (bars), and the refinement's trials with their best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if refine_values else 1, figsize=(12 if refine_values else 7, 4),
                             squeeze=False)
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


def plot_graph(graph: DataflowGraph, plan: Plan, path: Path, per_row: int = 50) -> None:
    """The model's nodes in execution order, wrapped in rows, coloured by backend.

    One square per node (post-DFS order, ``per_row`` to a row); a white gap marks where one
    region ends and the next begins, so both the backend mix and the region sizes show.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    region_of = {n: k for k, r in enumerate(plan.regions) for n in r.nodes}
    backend_of = {n: r.backend for r in plan.regions for n in r.nodes}
    rows = (len(graph) + per_row - 1) // per_row
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.3 * rows))
    for n in range(len(graph)):
        x, y = n % per_row, -(n // per_row)
        new_region = n > 0 and region_of.get(n) != region_of.get(n - 1)
        gap = 0.3 if new_region else 0.0  # nodes of one region touch; a region starts after a gap
        ax.add_patch(Rectangle((x + gap, y), 1.0 - gap, 0.8, color=_colour(backend_of.get(n, "?")), lw=0))
    ax.set_xlim(-0.5, per_row + 0.5)
    ax.set_ylim(-rows + 0.5, 1.3)
    ax.axis("off")
    used = sorted(set(backend_of.values()))
    ax.legend(handles=[Patch(color=_colour(b), label=f"{b} ({sum(v == b for v in backend_of.values())})")
                       for b in used], loc="upper left", ncol=len(used), frameon=False,
              bbox_to_anchor=(0, 1.02 + 0.6 / (rows + 1)))
    ax.set_title(f"{plan.model}: {len(graph)} nodes in execution order, {len(plan.regions)} regions",
                 loc="right", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_pareto(points: list[tuple[float, float]], front: list[dict], path: Path) -> None:
    """Latency against peak memory: every refinement trial, and the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([t * 1e3 for t, _ in points], [m for _, m in points], "o",
            color="#999999", label="variant")
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


def write_report(storage: str, study_name: str, plan: Plan, out: Path, model=None,
                 refine_study: str | None = None) -> Path:
    """Write ``out``/report.md and its PNGs for the job whose emitted plan is ``plan``
    (``refine_study``: the job's refinement study); returns the Markdown path."""
    notes = plan.notes
    out.mkdir(parents=True, exist_ok=True)
    trials = []
    if refine_study is not None:
        trials = [t for t in optuna.load_study(study_name=refine_study, storage=storage).trials
                  if t.state == optuna.trial.TrialState.COMPLETE and all(v < float("inf") for v in t.values)]
    plot_history(notes.get("end_to_end_s", {}), [t.values[0] for t in trials], out / "history.png")
    front = [f for f in notes.get("pareto_front", []) if f.get("peak_bytes") is not None]
    if front:
        plot_pareto([(t.values[0], t.values[1]) for t in trials if len(t.values) > 1], front, out / "pareto.png")
    shares = plot_shares(plan, out / "shares.png")
    if model is not None:
        plot_graph(model.graph, plan, out / "graph.png")
    lines = [f"# {plan.model}: tuning job '{study_name}'", ""]
    chosen = notes.get("chosen_as", "?")
    verdict = notes.get("verdict_median_s", {})
    if plan.model_file is not None:
        lines.append(f"Emitted plan: **{chosen}**: no partitioned plan beat the model's own ONNX graph "
                     f"({plan.model_file.origin}) under {plan.model_file.library}, so that is the plan "
                     f"(the best partitioned one, '{notes.get('best_partitioned')}', was slower).")
    else:
        lines.append(f"Emitted plan: **{chosen}**, {len(plan.regions)} regions over "
                     f"{', '.join(plan.backends)}.")
    if "speedup_vs_best_peer" in notes and plan.model_file is None:
        x = notes["speedup_vs_best_peer"]
        lines.append(f"Against the best peer ({notes['best_peer']}): **{x:.2f}x** "
                     f"({'faster' if x >= 1 else 'slower'}; medians of interleaved rounds in one process).")
    if notes.get("dp_estimate_s") and notes.get("end_to_end_s", {}).get(notes.get("dp_label")):
        est, meas = notes["dp_estimate_s"], notes["end_to_end_s"][notes["dp_label"]]
        lines.append(f"DP estimate {est * 1e3:.3f} ms vs measured {meas * 1e3:.3f} ms ({est / meas - 1:+.0%}); "
                     f"{notes.get('border_model', '')}.")
    lines += ["", "## Finalists and peers (one process, interleaved)", "",
              "| contender | median ms |", "|---|---|"]
    lines += [f"| {k} | {v * 1e3:.3f} |" for k, v in sorted(verdict.items(), key=lambda kv: kv[1])]
    lines += ["", "## Plans measured end to end", "", "![history](history.png)", "",
              "## Where the time goes", "", "| backend | nodes | region time |", "|---|---|---|"]
    total = sum(t for _, t in shares.values()) or 1.0
    lines += [f"| {b} | {n} | {t / total:.1%} |" for b, (n, t) in sorted(shares.items())]
    lines += ["", "![shares](shares.png)", ""]
    if front:
        lines += ["## Latency vs peak memory (Pareto front)", "",
                  "Each variant measured in a fresh process; memory is what the built plan keeps "
                  "resident plus what its runs add.", "",
                  "| plan file | best ms | peak MiB | backends |", "|---|---|---|---|"]
        lines += [f"| PLAN.front{i}.json | {f['latency_s'] * 1e3:.3f} | {f['peak_bytes'] / 2**20:.1f} | "
                  f"{'+'.join(f['backends'])} |" for i, f in enumerate(front, 1)]
        lines += ["", "![pareto](pareto.png)", ""]
    if model is not None:
        lines += ["## The model by backend", "", "![graph](graph.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
