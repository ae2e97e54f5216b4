"""Does the Optuna refinement pay? The refined plan against the DP plan and the best
single-backend plan, timed in one process, interleaved, on a zoo transformer and CNN.

For each model: ``partune.search.collage`` with ``--n-trials`` refinement trials (TPE), on the bench
store (measurements already there are reused). Then the DP's final plan, the refined
plan, the fastest single-backend plan and onnxruntime on the model (the peer) meet in
one worker process over interleaved rounds; medians are compared. With ``--memory`` the
refinement is NSGA-II on latency and peak memory and its Pareto front is listed. The
emitted plan is exported and run by ``partune run DIR`` in a fresh process (the deploy
path imports no search code). Writes experiments/results/refine.md and refine.json.

    python experiments/bench_refine.py [MODEL ...] [--n-trials 24] [--memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"
ROUNDS = 9


def bench_one(spec: str, args) -> dict:
    import tvm

    from partune.core.versions import device_fingerprint
    from partune.export import export
    from partune.frontend.models import load
    from partune.runners.builder import compare_request
    from partune.runners.local import LocalRunner
    from partune.runners.peers import peer_label, peer_specs
    from partune.search.collage import tune
    from partune.store.measurements import MeasurementStore

    model = load(spec)
    store = MeasurementStore(args.storage, device_fingerprint(1))
    with LocalRunner(timeout_s=300.0) as runner:
        start = time.monotonic()
        result = tune(
            model,
            args.backends.split(","),
            runner,
            store,
            peers=("onnxruntime",),
            refine_trials=args.n_trials,
            memory=args.memory,
        )
        search_s = time.monotonic() - start
        singles = {
            label: m for label, m in result.end_to_end.items() if label.endswith("-only") and m.ok
        }
        best_single = min(singles, key=lambda label: singles[label].cost_s)
        plans = {"dp": result.plans[result.dp_label], best_single: result.plans[best_single]}
        if "partune refined" in result.plans:
            plans["refined"] = result.plans["partune refined"]
        specs = peer_specs(model, ("onnxruntime",))
        request = compare_request(tvm.ir.save_json(model.mod), plans, specs, model.inputs, ROUNDS)
        verdict = runner.compare(request, timeout_s=900.0)
    row = {
        "model": spec,
        "search_s": search_s,
        "dp_label": result.dp_label,
        "best_single": best_single,
        "refined": "refined" in plans,
        "trials": args.n_trials,
        "measured": result.counts.measured,
        "median_ms": {k: m.median_s * 1e3 for k, m in verdict.items() if m.ok},
        "peer": peer_label("onnxruntime", model),
        "emitted": result.plan.notes.get("chosen_as"),
        "front": [
            {"ms": m.cost_s * 1e3, "mib": (m.peak_bytes or 0) / 2**20, "backends": list(p.backends)}
            for p, m in result.front
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "deploy"
        export(model, result.plan, out, 1)
        run = subprocess.run(
            [sys.executable, "-m", "partune.cli", "run", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        row["deployed"] = [
            ln for ln in run.stdout.splitlines() if ln.startswith(("latency", "max |err|"))
        ]
    return row


def write(rows: list[dict]) -> None:
    lines = [
        "# Refinement: refined plan vs DP plan vs best single backend (one process, interleaved)",
        "",
        f"1 thread, batch 1; medians of {ROUNDS} interleaved rounds; TPE unless noted. "
        "ratio = DP median / refined median (above 1: refinement helped).",
        "",
        "| model | trials | DP plan ms | refined ms | best single (ms) | onnxruntime ms "
        "| DP / refined | search s | deployed (fresh process) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["median_ms"]
        dp, ref, single, peer = (
            ms.get("dp"),
            ms.get("refined"),
            ms.get(r["best_single"]),
            ms.get(r["peer"]),
        )
        ratio = f"{dp / ref:.2f}x" if dp and ref else "1.00x (kept)"
        refined = f"{ref:.3f}" if ref else f"DP plan ({r['trials']} variants, none faster)"
        dep = "; ".join(r["deployed"])
        lines.append(
            f"| {r['model']} | {r['trials']} | {dp:.3f} | {refined} | {r['best_single']} "
            f"({single:.3f}) | {peer:.3f} | {ratio} | {r['search_s']:.0f} | {dep} |"
        )
    for r in rows:
        if r["front"]:
            lines += [
                "",
                f"Pareto front for {r['model']} (latency vs peak memory, fresh process each):",
                "",
                "| ms | peak MiB | backends |",
                "|---|---|---|",
            ]
            lines += [
                f"| {f['ms']:.3f} | {f['mib']:.1f} | {'+'.join(f['backends'])} |"
                for f in r["front"]
            ]
    (RESULTS / "refine.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "refine.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["bert-small", "resnet50-small"])
    p.add_argument("--n-trials", type=int, default=24)
    p.add_argument("--memory", action="store_true", help="NSGA-II on latency and peak memory")
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument("--storage", default=f"sqlite:///{RESULTS / 'measurements.db'}")
    args = p.parse_args()
    rows = []
    for spec in args.models:
        rows.append(bench_one(spec, args))
        print(json.dumps(rows[-1]), flush=True)
    write(rows)
    print((RESULTS / "refine.md").read_text())


if __name__ == "__main__":
    main()
