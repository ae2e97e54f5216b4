"""What do a plan's MetaSchedule-tuned regions buy? The plan against its untuned twin.

The twin is the same plan with every ``tvm-tuned`` region put back on ``tvm`` (TVM's
default schedules): same partitioning, same libraries, only the schedules differ. Both
are built and timed in this process, in interleaved rounds, with onnxruntime on the
model's ONNX export beside them, and written to experiments/results/tuned_plan.md.

    python experiments/bench_tuned_plan.py gpt2-small \\
        experiments/results/gpt2-small.tuned.plan.json \\
        --tuning-database experiments/results/measurements.tuning
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def untuned_twin(doc: dict) -> dict:
    """The plan document with its tuned TVM regions on untuned TVM."""
    twin = json.loads(json.dumps(doc))
    for region in twin["regions"]:
        if region["scope"]["backend"] == "tvm-tuned":
            region["scope"]["backend"] = "tvm"
    return twin


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="zoo name")
    p.add_argument("plan", help="a plan JSON with tvm-tuned regions")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument(
        "--tuning-database", required=True, help="the tvm-tuned records the plan was tuned into"
    )
    args = p.parse_args()

    from partune.backends import registry
    from partune.backends.settings import Settings

    registry.configure(Settings(tuning_database=str(Path(args.tuning_database).resolve())))
    from partune.core.plan import Plan
    from partune.frontend.models import load
    from partune.runners.builder import build_plan
    from partune.runners.peers import make_peer, peer_specs
    from partune.runners.timing import time_interleaved

    model = load(args.model)
    doc = json.loads(Path(args.plan).read_text())
    tuned = sum(r["scope"]["backend"] == "tvm-tuned" for r in doc["regions"])
    plans = {
        "plan (tuned regions)": Plan.from_json(doc),
        "same plan, untuned TVM": Plan.from_json(untuned_twin(doc)),
    }
    fns = {
        label: build_plan(plan, model.mod, model.graph).prepare(model.inputs)
        for label, plan in plans.items()
    }
    fns |= {
        label: make_peer(spec, model.inputs, 1)
        for label, spec in peer_specs(model, ("onnxruntime",)).items()
    }
    medians = {label: m.median_s for label, m in time_interleaved(fns, rounds=args.rounds).items()}
    base = medians["plan (tuned regions)"]
    lines = [
        f"# {args.model}: the emitted plan's {tuned} tuned TVM regions against untuned TVM",
        "",
        f"Plan `{args.plan}`; {args.rounds} interleaved rounds in one process, medians.",
        "",
        "| contender | median ms | x the tuned plan |",
        "|---|---|---|",
    ]
    lines += [
        f"| {label} | {s * 1e3:.4f} | {s / base:.3f} |"
        for label, s in sorted(medians.items(), key=lambda kv: kv[1])
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "experiments" / "results" / "tuned_plan.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
