"""Partune's emitted plan against the tools a user would pick instead, per model.

For each model (the zoo, and ONNX exports of architectures the zoo does not hold, built
in experiments/architectures.py and exported as a user would), run ``partune tune``
exactly as a user does, then read what its interleaved verdict measured: the emitted
plan against onnxruntime and OpenVINO on the model as given (the user's ONNX file, or a
``torch.onnx.export`` of a zoo model) and torch.compile where a torch module exists.
Writes experiments/results/vs_peers.md: per model the plan, each peer, the ratio to the
best peer, the DP's estimate error, and the geometric mean.

``--held-out`` runs exactly the held-out architectures (``HELD_OUT`` in architectures.py,
which no tuning decision may use) instead, with a store of their own, and writes
experiments/results/vs_peers_held_out.md with their own geometric mean.

    python experiments/bench_vs_peers.py [MODEL ...] [--backends ...] [--timeout 15m]
    python experiments/bench_vs_peers.py --held-out
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

ZOO = [
    "bert-small",
    "resnet50-small",
    "mobilenet_v2-small",
    "convnext-small",
    "vit-small",
    "gpt2-small",
]
EXPORTS = [
    "mobilenet_v3_small",
    "shufflenet_v2",
    "squeezenet1_1",
    "convnext_atto",
    "distilbert",
    "llama",
    "densenet",
    "unet",
    "efficientnet",
    "mobilevit",
    "whisper_encoder",
    "wav2vec2",
    "phi",
    "deberta",
]
RESULTS = ROOT / "experiments" / "results"


def _export(name: str, folder: Path, exporter: str = "legacy") -> tuple[str, list[str]]:
    """The architecture as an ONNX file (dynamic axes) and its --input-shape flags."""
    from experiments.architectures import export_onnx, get

    arch = get(name)
    path = folder / f"{name}.onnx"
    export_onnx(arch, path, exporter=exporter)
    _, inputs = arch.build()
    flags = []
    for input_name, tensor in zip(arch.input_names, inputs, strict=True):
        flags += ["--input-shape", f"{input_name}={','.join(str(d) for d in tensor.shape)}"]
    return str(path), flags


def tune_one(spec: str, flags: list[str], args, out: Path) -> dict:
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
        "-o",
        str(out),
        "--refine-trials",
        "8",
    ]  # the default search's fixed work: the timeout only bounds it
    if args.tune_budget:
        cmd += ["--tune-budget", args.tune_budget, "--tune-trials", str(args.tune_trials)]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {
        "model": Path(spec).stem if spec.endswith(".onnx") else spec,
        "wall_s": time.monotonic() - start,
        "measured": f"{time.strftime('%Y-%m-%d %H:%M')} at {_commit()}",
    }
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    notes = json.loads(out.read_text())["notes"]
    stats = re.search(r"search ([\d.]+) s; candidates (\d+); measurements made (\d+)", done.stdout)
    row |= {
        "chosen_as": notes["chosen_as"],
        "verdict": notes.get("verdict_median_s", {}),
        "best_peer": notes.get("best_peer"),
        "peers": notes.get("peers", []),
        "speedup": notes.get("speedup_vs_best_peer"),
        "dp_estimate_s": notes.get("dp_estimate_s"),
        "dp_measured_s": notes.get("end_to_end_s", {}).get(notes.get("dp_label", "partune dp")),
        "backends": sorted({r["scope"]["backend"] for r in json.loads(out.read_text())["regions"]}),
        "search_s": float(stats.group(1)) if stats else None,
        "measurements": int(stats.group(3)) if stats else None,
        "tuned_regions_in_plan": sum(
            r["scope"]["backend"] == "tvm-tuned" for r in json.loads(out.read_text())["regions"]
        ),
    }
    if tuning := re.search(
        r"auto-tuning: (\d+) regions tuned \((\d+) MetaSchedule trials\) in (\d+) s", done.stdout
    ):
        row |= {
            "tuned_regions": int(tuning.group(1)),
            "tuning_trials": int(tuning.group(2)),
            "tuning_s": int(tuning.group(3)),
        }
    details = Path(args.out).with_suffix("")  # results/vs_peers.md -> results/vs_peers/MODEL.txt
    details.mkdir(parents=True, exist_ok=True)
    (details / f"{row['model']}.txt").write_text(done.stdout)
    return row


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def row_isa(row: dict) -> str:
    """The instruction set a result row was measured on; rows from before rows kept it came
    from the AVX2 machines."""
    return row.get("isa", "AVX2")


def merged(earlier: list[dict], new: list[dict]) -> list[dict]:
    """``earlier``'s rows with those of the models in ``new`` replaced (new models appended)."""
    fresh = {r["model"]: r for r in new}
    return [fresh.pop(r["model"], r) for r in earlier] + list(fresh.values())


def table(rows: list[dict]) -> str:
    kinds = (
        "onnxruntime",
        "openvino",
        "torch.compile",
    )  # one column a peer kind; labels say which graph ran
    tuning = any("tuned_regions" in r for r in rows)
    head = [
        "model",
        "emitted plan",
        "backends",
        "plan ms",
        *[f"{k} ms" for k in kinds],
        "x best peer",
        "DP est. error",
        "search s",
        "measurements",
        *(["tuned (trials, s)", "tuned regions in plan"] if tuning else []),
        "measured",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        v = r["verdict"]
        plan_ms = v.get(r["chosen_as"], float("nan")) * 1e3
        cells = [r["model"], r["chosen_as"], "+".join(r["backends"]), f"{plan_ms:.3f}"]
        for kind in kinds:
            label = next((p for p in r.get("peers", []) if p.startswith(kind)), None)
            cells.append(f"{v[label] * 1e3:.3f}" if label in v else "unavailable" if label else "-")
        cells.append(f"**{r['speedup']:.2f}x**" if r.get("speedup") else "-")
        est, meas = r.get("dp_estimate_s"), r.get("dp_measured_s")
        cells.append(f"{(est - meas) / meas:+.0%}" if est and meas else "-")
        cells += [
            f"{r['search_s']:.0f}" if r.get("search_s") else "-",
            str(r.get("measurements", "-")),
        ]
        if tuning:
            cells += [
                (
                    f"{r.get('tuned_regions', 0)} "
                    f"({r.get('tuning_trials', 0)}, {r.get('tuning_s', 0)})"
                ),
                str(r.get("tuned_regions_in_plan", 0)),
            ]
        cells.append(r.get("measured", "-"))
        lines.append("| " + " | ".join(cells) + " |")
    ok = [r["speedup"] for r in rows if r.get("speedup")]
    if ok:
        geo = math.exp(sum(math.log(x) for x in ok) / len(ok))
        lines.append("")
        lines.append(
            f"geomean vs the best peer over {len(ok)} models: **{geo:.2f}x**; "
            f"slowest {min(ok):.2f}x, fastest {max(ok):.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models", nargs="*", help=f"zoo names or architectures (default: {' '.join(ZOO + EXPORTS)})"
    )
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument(
        "--storage",
        help="measurement store (default: results/measurements.db; with --held-out "
        "results/measurements_held_out.db, so nothing learnt from the store ever sees them)",
    )
    p.add_argument("--timeout", default="15m", help="per-model limit on measuring candidates")
    p.add_argument(
        "--out", help="report (default: results/vs_peers.md; with --held-out vs_peers_held_out.md)"
    )
    p.add_argument(
        "--held-out",
        action="store_true",
        help="run exactly the held-out architectures, reported on their own (see architectures.py)",
    )
    p.add_argument(
        "--exporter",
        choices=("legacy", "dynamo"),
        default="legacy",
        help=(
            "how the architectures are exported (dynamo: torch's default; OpenVINO cannot read "
            "some)"
        ),
    )
    p.add_argument("--tune-budget", help="auto-tune TVM regions for this long per model (e.g. 4m)")
    p.add_argument(
        "--tune-trials", type=int, default=32, help="MetaSchedule trials per tuned region"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="replace these models' rows in the report already at --out (its .json), keeping "
        "the others; each row says when and at which commit it was measured",
    )
    p.add_argument(
        "--threads",
        default="1",
        help="threads for every contender: N, or 'all' (every core); at "
        "more than one, each contender is timed in a process of its own, one at a time",
    )
    args = p.parse_args(argv)
    from experiments.architectures import HELD_OUT

    if args.held_out and args.models:
        p.error("--held-out runs exactly the held-out set; name no models with it")
    if held := [m for m in args.models if m in HELD_OUT]:
        p.error(f"{', '.join(held)}: held out, run only with --held-out")
    models = list(HELD_OUT) if args.held_out else args.models or ZOO + EXPORTS
    suffix = "_held_out" if args.held_out else ""
    args.out = args.out or str(RESULTS / f"vs_peers{suffix}.md")
    args.storage = args.storage or f"sqlite:///{RESULTS / f'measurements{suffix}.db'}"
    args.threads = os.cpu_count() or 1 if args.threads == "all" else int(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    earlier = json.loads(Path(args.out).with_suffix(".json").read_text()) if args.merge else []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            spec, flags = (
                _export(name, Path(tmp), args.exporter)
                if name in (*EXPORTS, *HELD_OUT)
                else (name, [])
            )
            rows.append(tune_one(spec, flags, args, Path(tmp) / f"{name}.plan.json"))
            every = merged(earlier, rows)
            text = table(every)
            Path(args.out).with_suffix(".json").write_text(json.dumps(every, indent=1))
            print(f"\n{text}", flush=True)
            Path(args.out).write_text(
                "# Emitted plan vs the best peer, interleaved rounds"
                + (" (held-out architectures)" if args.held_out else "")
                + "\n\n"
                f"{args.threads} thread(s) "
                f"({'one process' if args.threads == 1 else 'a process a contender'}), batch 1, "
                f"backends {args.backends}"
                + (
                    f" + tvm-tuned (MetaSchedule, {args.tune_budget} per model, {args.tune_trials} "
                    "trials a region)"
                    if args.tune_budget
                    else ""
                )
                + "; peers: onnxruntime and OpenVINO (f32, latency hint) on the model as given "
                "(the .onnx file; a torch.onnx.export for zoo models) and torch.compile where a "
                "torch module exists; 'unavailable': the peer could not read the model. An "
                "emitted plan named after a peer is the model's own file under that library (no "
                "partitioned plan beat it). Ratios are medians over interleaved rounds of each "
                "round's fastest repeat; x best peer > 1 means the plan is faster. DP est. error: "
                "the DP's estimate against its plan measured end to end.\n\n" + text + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
