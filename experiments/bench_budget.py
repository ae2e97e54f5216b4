"""Plan quality against time budget: the same job run with longer and longer ``--timeout``.

For each model, one store: ``partune tune MODEL --timeout B`` for each budget in increasing
order (defaults, all four backends, the peers on), so that a shorter budget's plan competes
again in a longer budget's verdict. Then every emitted plan is timed against the others
in this process, interleaved. A longer budget's plan should never be slower, beyond 2%.
Writes experiments/results/budget.md (and .json); a budget run again replaces its row, and
every budget's plan of the model is timed again with the others.

    python experiments/bench_budget.py gpt2-small mobilenet_v2-small --budgets 10m 30m 90m
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.bench_cost_model import time_plans  # noqa: E402
from experiments.bench_vs_peers import EXPORTS, RESULTS, _commit, _export  # noqa: E402
from partune.commands.common import parse_duration  # noqa: E402

SLOWER_AT_MOST = 1.02  # a longer budget's plan against the shorter ones'


def _run(spec: str, flags: list[str], budget: str, storage: str, out: Path) -> dict:
    """One ``partune tune`` with this budget: what it spent, measured and emitted."""
    cmd = [
        sys.executable,
        "-m",
        "partune.cli",
        *flags,
        "tune",
        spec,
        "--storage",
        storage,
        "--timeout",
        budget,
        "-o",
        str(out),
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"budget": budget, "wall_s": time.monotonic() - start}
    if done.returncode != 0:
        return row | {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    out.with_suffix(".txt").write_text(done.stdout)
    notes = json.loads(out.read_text())["notes"]
    stats = re.search(r"measurements made (\d+)", done.stdout)
    tuning = re.search(
        r"auto-tuning: (\d+) regions tuned \((\d+) MetaSchedule trials\) in (\d+) s", done.stdout
    )
    refined = re.search(r"refinement: (\d+) plan variants in its study(, converged)?", done.stdout)
    phases = re.search(r"time by phase: (.*)", done.stdout)
    return row | {
        "plan": notes["chosen_as"],
        "speedup": notes.get("speedup_vs_best_peer"),
        "best_peer": notes.get("best_peer"),
        "measurements": int(stats.group(1)) if stats else None,
        "tuning": [int(g) for g in tuning.groups()] if tuning else None,
        "refine_trials": int(refined.group(1)) if refined else 0,
        "converged": bool(refined and refined.group(2)),
        "phases": phases.group(1) if phases else "",
    }


def bench(name: str, budgets: list[str], folder: Path, earlier: dict | None) -> dict:
    """Run ``budgets`` on the model's store; keep the rows of budgets run before (``earlier``)
    and not now, and time every budget's plan (this run's and those) interleaved."""
    spec, flags = _export(name, folder) if name in EXPORTS else (name, [])
    storage = f"sqlite:///{folder / name}.db"
    new = {
        b: _run(spec, flags, b, storage, folder / f"{name}.{b}.plan.json") | {"at": _commit()}
        for b in budgets
    }
    rows = {r["budget"]: r for r in (earlier or {}).get("rows", [])} | new
    rows = dict(sorted(rows.items(), key=lambda kv: parse_duration(kv[0])))
    ok = {b: folder / f"{name}.{b}.plan.json" for b, r in rows.items() if "error" not in r}
    if ok:
        for budget, median in time_plans(spec, flags, ok).items():
            rows[budget]["median_s"] = median
    return {
        "model": name,
        "rows": list(rows.values()),
        "measured": f"{time.strftime('%Y-%m-%d %H:%M')} at {_commit()}",
    }


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines += [
            f"### {res['model']} ({res['measured']})",
            "",
            "| --timeout | wall min | measurements made | tuned (regions, trials, s) "
            "| refinement trials | emitted plan | plan ms (interleaved) "
            "| x the shorter budgets' best | x best peer (verdict) | time by phase | at |",
            "|" + "---|" * 11,
        ]
        best = None
        for r in res["rows"]:
            if "error" in r:
                lines.append(
                    f"| {r['budget']} | {r['wall_s'] / 60:.1f} | failed: {r['error']} |" + " |" * 8
                )
                continue
            ms = r.get("median_s")
            vs = f"{best / ms:.3f}" if best and ms else "-"
            best = min(best or ms, ms) if ms else best
            tuned = ", ".join(map(str, r["tuning"])) if r["tuning"] else "-"
            trials = f"{r['refine_trials']}" + (" (converged)" if r["converged"] else "")
            lines.append(
                f"| {r['budget']} | {r['wall_s'] / 60:.1f} | {r['measurements']} | {tuned} | "
                f"{trials} | {r['plan']} | {ms * 1e3:.3f} | {vs} | {r['speedup']:.2f}x "
                f"{r['best_peer']} | {r['phases']} | {r.get('at', '')} |"
                if ms
                else ""
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models", nargs="+", help="zoo names or architectures of experiments/architectures.py"
    )
    p.add_argument(
        "--budgets",
        nargs="*",
        default=["10m", "30m", "90m"],
        help="--timeout values, shortest first (none: time the plans of the earlier runs again)",
    )
    p.add_argument("--folder", default="/tmp/partune-budget", help="stores, exports and plans")
    p.add_argument("--out", default=str(RESULTS / "budget.md"))
    args = p.parse_args(argv)
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    earlier = (
        {r["model"]: r for r in json.loads(out.with_suffix(".json").read_text())}
        if out.with_suffix(".json").exists()
        else {}
    )
    results = earlier | {
        name: bench(name, args.budgets, folder, earlier.get(name)) for name in args.models
    }
    results = list(results.values())
    text = table(results)
    print(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.write_text(
        "# Plan quality against time budget\n\n"
        "`experiments/bench_budget.py`: one store per model, `partune tune MODEL --timeout B` for "
        "each budget, shortest first (defaults: all four backends, 1 thread, the peers on), so "
        "that a shorter budget's plan competes in a longer one's verdict; then every emitted plan "
        "timed against the others in one process, interleaved (medians of 21 rounds; a budget "
        "that emitted the same plan as a shorter one shares its timing). *x the shorter budgets' "
        "best* above 1: the longer budget's plan is faster; it should never be below "
        f"{1 / SLOWER_AT_MOST:.2f}.\n\n" + text + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
