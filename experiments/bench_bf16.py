"""bf16 within an accuracy budget, against f32 and against the peers at that budget.

For each model, ``partune tune --precision bf16 --tolerance REL`` is run exactly as a user
runs it (the f32 candidates it shares with an f32 run are read from the store, not
measured again). Its interleaved verdict then holds, timed in one run: the emitted plan,
the fastest all-f32 plan (always a finalist when bf16 is on), OpenVINO in bf16 and the f32
peers. Writes experiments/results/bf16.md: per model the bf16-budget plan and its error,
its share of time in bf16 regions, the f32 plan, OpenVINO bf16 and its error (marked when
over the budget), the best f32 peer, and the ratios to the f32 plan and to the fastest
peer the budget allows.

    python experiments/bench_bf16.py [MODEL ...] [--tolerance 1e-2] [--threads 1|all]

A run of some models replaces their rows and keeps the others' (each row in the .json has its date).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_vs_peers import EXPORTS, RESULTS, _export  # noqa: E402

DEFAULT_MODELS = [
    "bert-small",
    "vit-small",
    "convnext-small",
    "gpt2-small",
    "distilbert",
    "whisper_encoder",
    "mobilevit",
    "deberta",
]


def tune_bf16(spec: str, flags: list[str], args, out: Path) -> dict:
    """One ``partune tune --precision bf16`` run, read back from its plan's notes."""
    cmd = [
        sys.executable,
        "-m",
        "partune.cli",
        "--threads",
        str(args.threads),
        *flags,
        "tune",
        spec,
        "--backends",
        args.backends,
        "--storage",
        args.storage,
        "--timeout",
        args.timeout,
        "--refine-trials",
        "8",  # the default search's fixed work: the timeout only bounds it
        "--precision",
        "bf16",
        "--tolerance",
        str(args.tolerance),
        "-o",
        str(out),
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row: dict = {
        "model": Path(spec).stem if spec.endswith(".onnx") else spec,
        "wall_s": time.monotonic() - start,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    plan = json.loads(out.read_text())
    notes = plan["notes"]
    verdict, errors, peers = (
        notes.get("verdict_median_s", {}),
        notes.get("rel_errors", {}),
        notes.get("peers", []),
    )
    plans = [label for label in verdict if label not in peers]
    f32_plans = [label for label in plans if label not in errors]
    costs = [(r.get("cost_s") or 0.0, r["scope"].get("precision")) for r in plan["regions"]]
    total = sum(c for c, _ in costs)
    stats = re.search(r"search ([\d.]+) s; candidates (\d+); measurements made (\d+)", done.stdout)
    row |= {
        "chosen_as": notes["chosen_as"],
        "verdict": verdict,
        "rel_errors": errors,
        "peers": peers,
        "plan_error": notes.get("rel_error"),
        "best_peer": notes.get("best_peer"),
        "speedup": notes.get("speedup_vs_best_peer"),
        "f32_plan": min(f32_plans, key=verdict.get) if f32_plans else None,
        "bf16_share": sum(c for c, p in costs if p == "bf16") / total if total else 0.0,
        "search_s": float(stats.group(1)) if stats else None,
        "measurements": int(stats.group(3)) if stats else None,
    }
    folder = Path(args.out).with_suffix("")  # bf16/ at one thread, bf16_all_cores/ at more
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{row['model']}.txt").write_text(done.stdout)
    return row


def _ms(v: float | None) -> str:
    return f"{v * 1e3:.3f}" if v else "-"


def _bf16_peer_cell(r: dict, prefix: str, tolerance: float) -> str:
    """A bf16 peer's median and error, marked when over the budget ("-": not a peer of this
    model)."""
    v, errors = r["verdict"], r["rel_errors"]
    peer = next((p for p in r["peers"] if p.startswith(prefix)), None)
    if peer not in v:
        return "unavailable" if peer else "-"
    over = errors.get(peer, 0.0) > tolerance
    return f"{_ms(v[peer])} ({errors.get(peer, float('nan')):.1e}{', over budget' if over else ''})"


def table(rows: list[dict], tolerance: float) -> str:
    head = [
        "model",
        "emitted plan",
        "plan ms",
        "plan error",
        "time in bf16",
        "f32 plan ms",
        "x f32 plan",
        "openvino bf16 ms (error)",
        "torch.compile bf16 ms (error)",
        "best f32 peer ms",
        "x best allowed peer",
        "search s",
        "measurements",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        v, errors = r["verdict"], r["rel_errors"]
        plan_s = v.get(r["chosen_as"])
        f32_s = v.get(r["f32_plan"]) if r["f32_plan"] else None
        bf16_cells = [
            _bf16_peer_cell(r, prefix, tolerance)
            for prefix in ("openvino bf16", "torch.compile bf16")
        ]
        f32_peers = [v[p] for p in r["peers"] if p in v and p not in errors]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    r["chosen_as"],
                    _ms(plan_s),
                    f"{r['plan_error']:.1e}" if r.get("plan_error") is not None else "f32",
                    f"{r['bf16_share']:.0%}",
                    _ms(f32_s),
                    f"{f32_s / plan_s:.2f}x" if f32_s and plan_s else "-",
                    *bf16_cells,
                    _ms(min(f32_peers)) if f32_peers else "-",
                    f"**{r['speedup']:.2f}x**" if r.get("speedup") else "-",
                    f"{r['search_s']:.0f}" if r.get("search_s") else "-",
                    str(r.get("measurements", "-")),
                ]
            )
            + " |"
        )
    ok = [r["speedup"] for r in rows if r.get("speedup")]
    if ok:
        geo = math.exp(sum(math.log(x) for x in ok) / len(ok))
        lines += [
            "",
            f"geomean vs the fastest peer the budget allows, over {len(ok)} models: "
            f"**{geo:.2f}x**; slowest {min(ok):.2f}x, fastest {max(ok):.2f}x",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models",
        nargs="*",
        help=f"zoo names or architectures (default: {' '.join(DEFAULT_MODELS)})",
    )
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument("--tolerance", type=float, default=1e-2)
    p.add_argument(
        "--storage",
        help="measurement store (default: results/measurements.db, shared with the f32 "
        "benchmark: f32 candidates are not measured twice)",
    )
    p.add_argument("--timeout", default="15m", help="per-model limit on measuring candidates")
    p.add_argument("--threads", default="1", help="threads for every contender: N, or 'all'")
    p.add_argument(
        "--out", help="report (default: results/bf16.md; at more threads bf16_all_cores.md)"
    )
    p.add_argument("--exporter", choices=("legacy", "dynamo"), default="legacy")
    args = p.parse_args(argv)
    args.threads = os.cpu_count() or 1 if args.threads == "all" else int(args.threads)
    args.out = args.out or str(RESULTS / ("bf16.md" if args.threads == 1 else "bf16_all_cores.md"))
    args.storage = args.storage or f"sqlite:///{RESULTS / 'measurements.db'}"
    models = args.models or DEFAULT_MODELS
    raw = Path(args.out).with_suffix(".json")  # rows of models run before and not now are kept
    by_model = {r["model"]: r for r in json.loads(raw.read_text())} if raw.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            spec, flags = _export(name, Path(tmp), args.exporter) if name in EXPORTS else (name, [])
            by_model[name] = tune_bf16(spec, flags, args, Path(tmp) / f"{name}.plan.json")
            order = DEFAULT_MODELS + [m for m in by_model if m not in DEFAULT_MODELS]
            rows = [by_model[m] for m in order if m in by_model]
            text = table(rows, args.tolerance)
            print(f"\n{text}", flush=True)
            raw.write_text(json.dumps(rows, indent=1))
            Path(args.out).write_text(
                f"# bf16 within a relative-error budget of {args.tolerance:g}\n\n"
                f"{args.threads} thread(s), batch 1, backends {args.backends}, `partune tune "
                f"--precision bf16 --tolerance {args.tolerance:g}`. All timings are medians of one "
                "interleaved verdict per model. plan error: the emitted plan's relative error "
                "against f32 (worst output, on the model's inputs and on a held-out seeded set). "
                "f32 plan: the fastest plan with no bf16 region (always a finalist). openvino "
                "bf16: OpenVINO on the model's file with bf16 inference precision (its default on "
                "CPUs with bf16); torch.compile bf16: the torch module (zoo models) under bf16 "
                "autocast; each with its error; over the budget a peer is no bar. x best allowed "
                "peer: against the fastest of the f32 peers and the bf16 peers within "
                "budget.\n\n" + text + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
