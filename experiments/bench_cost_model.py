"""Does the cost model make a search measure less, and is its plan as good?

For a held-out model (a zoo name, or an architecture of ``experiments/architectures.py``
exported to ONNX as the benchmark does): train the cost model on the other benchmark
models' measurements in a store (``partune costmodel eval --models ... --save``), then tune the
held-out model twice on fresh stores — measuring everything, and with ``--cost-model`` — and time
the two emitted plans against each other in one process, interleaved. Writes
experiments/results/cost_model_search.md.

    python experiments/bench_cost_model.py \\
        --store sqlite:///experiments/results/measurements.db vit-small
    python experiments/bench_cost_model.py --store ... --out cost_model_search_exports.md \\
        distilbert efficientnet
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.bench_vs_peers import EXPORTS, ZOO, _export  # noqa: E402


def _partune(*args: str) -> tuple[str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "partune.cli", *args], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(
            f"partune {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}"
        )
    return done.stdout, time.monotonic() - start


def _made(out: str) -> int:
    return int(re.search(r"measurements made (\d+)", out).group(1))


def time_plans(
    spec: str, flags: list[str], plans: dict[str, Path], threads: int = 1, rounds: int = 21
) -> dict[str, float]:
    """Median latency of each emitted plan (partitioned, or the model's own file under a
    library), timed in this process in interleaved rounds. Plans that are the same plan are
    timed once (a budget or a search that emitted the same plan gets the same time)."""
    from partune.core.keys import plan_key
    from partune.core.plan import Plan
    from partune.frontend.models import load
    from partune.runners.builder import build_model_file, build_plan
    from partune.runners.timing import time_interleaved
    from partune.search import model_file_data

    model = load(spec, _shapes(flags) or None)
    fns, same = {}, {}
    for label, path in plans.items():
        plan = Plan.load(path)
        key = repr(plan.model_file) if plan.model_file is not None else plan_key(plan)
        if key in same.values():
            same[label] = key
            continue
        same[label] = key
        built = (
            build_model_file(plan, model_file_data(model, plan.model_file), model.inputs, threads)
            if plan.model_file is not None
            else build_plan(plan, model.mod, model.graph)
        )
        fns[label] = built.prepare(model.inputs)
    medians = {label: m.median_s for label, m in time_interleaved(fns, rounds=rounds).items()}
    first = {key: label for label, key in reversed(same.items())}
    return {label: medians[first[key]] for label, key in same.items()}


def _shapes(flags: list[str]) -> dict[str, tuple[int, ...]]:
    """``--input-shape NAME=D,D`` flags as load() takes them."""
    pairs = [flags[i + 1].split("=") for i in range(0, len(flags), 2)]
    return {name: tuple(int(d) for d in dims.split(",")) for name, dims in pairs}


def _training_models(folder: Path) -> dict[str, str]:
    """Every benchmark model as ``costmodel eval --models`` loads it: zoo names, and the
    architectures exported with static shapes (their graphs, and so the measurement keys in the
    benchmark store, are those of the dynamic exports tuned with ``--input-shape``)."""
    from experiments.architectures import export_onnx

    files = {name: name for name in ZOO}
    for name in EXPORTS:
        export_onnx(name, folder / f"{name}.onnx", dynamic=False)
        files[name] = str(folder / f"{name}.onnx")
    return files


def _held_out(name: str, trained_on: dict[str, str], store: str) -> tuple:
    """One row: ``name`` tuned measuring everything, and with a cost model trained without it."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        spec, flags = _export(name, t) if name in EXPORTS else (name, [])
        others = ",".join(f for m, f in trained_on.items() if m != name)
        _partune(
            "costmodel",
            "eval",
            "--storage",
            store,
            "--models",
            others,
            "--save",
            str(t / "cm.json"),
        )
        common = ["--peers", "none", "--refine-trials", "0"]
        full, full_s = _partune(
            *flags,
            "tune",
            spec,
            "--storage",
            f"sqlite:///{t / 'a.db'}",
            "-o",
            str(t / "full.json"),
            "--cost-model",
            "off",
            *common,
        )
        pruned, pruned_s = _partune(
            *flags,
            "tune",
            spec,
            "--storage",
            f"sqlite:///{t / 'b.db'}",
            "-o",
            str(t / "pruned.json"),
            "--cost-model",
            str(t / "cm.json"),
            *common,
        )
        lat = time_plans(
            spec, flags, {"full": t / "full.json", "pruned": t / "pruned.json"}, rounds=9
        )
        notes = json.loads((t / "pruned.json").read_text())["notes"]
        return (
            name,
            _made(full),
            full_s,
            _made(pruned),
            pruned_s,
            lat["full"],
            lat["pruned"],
            notes["chosen_as"],
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("held_out", nargs="+", help="benchmark models to hold out, one at a time")
    p.add_argument("--store", required=True, help="storage whose other models train the cost model")
    p.add_argument("--out", default="cost_model_search.md", help="report, in experiments/results/")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as shared:
        trained_on = _training_models(Path(shared))
        for name in args.held_out:
            rows.append(_held_out(name, trained_on, args.store))
    lines = [
        "| held-out model | measurements (all) | search s | measurements (cost model) | search s | "
        "fewer | plan ms (all) | plan ms (cost model) | ratio |",
        "|" + "---|" * 9,
    ]
    for name, fm, fs, pm, ps, fl, pl, _ in rows:
        lines.append(
            f"| {name} | {fm} | {fs:.0f} | {pm} | {ps:.0f} | **{fm / pm:.1f}x** | {fl * 1e3:.3f} | "
            f"{pl * 1e3:.3f} | {pl / fl:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    out = ROOT / "experiments" / "results" / args.out
    out.write_text(
        "# Searching with the cost model (held-out model, fresh stores)\n\n"
        "Cost model trained on the other benchmark models' measurements in the benchmark store; "
        "both searches with --peers none --refine-trials 0; the plans timed against each other "
        "in one process, interleaved (medians). ratio = cost-model plan / full plan.\n\n"
        + text
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
