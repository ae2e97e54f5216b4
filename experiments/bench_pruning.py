"""The default search against the exhaustive one on the scaling subjects: what the cost model costs
in plan quality.

The default search ranks candidates with the cost model kept beside its store and measures
the promising ones; ``--cost-model off`` measures every candidate. On a fresh store the two are
the same search (the cost model has learnt nothing yet), so the default search here runs on a
copy of the benchmark's store (experiments/results/measurements.db, with its cost model): a
user who tuned other models before. The subject is in neither store. Both searches run with
``--peers none`` (the emitted plan is a partitioned plan, not a peer's file), and both plans
are then timed in one process, interleaved (21 rounds). The goal: the default plan within 2% of
the exhaustive one, with fewer measurements. Writes experiments/results/pruning.md (and .json;
a subject run again replaces its row).

    python experiments/bench_pruning.py bert_l2 resnet50 bert_l12 [--folder /tmp/partune-scale]

Run it on a quiet machine: the searches' timings, and the plans' timings, are the result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments.bench_cost_model import time_plans  # noqa: E402
from experiments.bench_scale import ORDER, _flags, _tune  # noqa: E402
from experiments.bench_vs_peers import RESULTS, _export  # noqa: E402

WITHIN = 1.02  # the default plan's latency over the exhaustive one's, at most
STORE = RESULTS / "measurements.db"


def bench(name: str, args, folder: Path) -> dict:
    path = folder / f"{name}.onnx"
    path, flags = (str(path), _flags(name)) if path.exists() else _export(name, folder)
    row: dict = {"model": name, "date": time.strftime("%Y-%m-%d %H:%M")}
    plans = {}
    for search in ("exhaustive", "default"):
        db = folder / f"{name}.{search}.db"
        for old in (db, db.with_suffix(".costmodel.json"), db.with_suffix(".costmodel.meta.json")):
            old.unlink(missing_ok=True)
        extra = ["--cost-model", "off"] if search == "exhaustive" else []
        if search == "default":
            shutil.copy(STORE, db)
            for suffix in (".costmodel.json", ".costmodel.meta.json"):
                if STORE.with_suffix(suffix).exists():
                    shutil.copy(STORE.with_suffix(suffix), db.with_suffix(suffix))
        plans[search] = folder / f"{name}.{search}.plan.json"
        row[search] = {
            k: v
            for k, v in _tune(path, flags, f"sqlite:///{db}", plans[search], args, extra).items()
            if k != "stdout_tail"
        }
        print(name, search, {k: v for k, v in row[search].items() if k != "command"}, flush=True)
    if all("error" not in row[s] for s in plans):
        row["median_s"] = time_plans(path, flags, plans)
    return row


def table(rows: list[dict]) -> str:
    head = [
        "model",
        "measurements (exhaustive)",
        "search min",
        "measurements (default)",
        "search min",
        "fewer",
        "exhaustive plan ms",
        "default plan ms",
        "default / exhaustive",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        full, pruned, med = r.get("exhaustive", {}), r.get("default", {}), r.get("median_s", {})
        if "error" in full or "error" in pruned:
            lines.append(
                f"| {r['model']} | failed: {full.get('error') or pruned.get('error')} |"
                + " |" * (len(head) - 2)
            )
            continue
        ratio = med["default"] / med["exhaustive"] if med else None
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    str(full.get("measured", "-")),
                    f"{full['search_s'] / 60:.1f}",
                    str(pruned.get("measured", "-")),
                    f"{pruned['search_s'] / 60:.1f}",
                    f"{full['measured'] / max(pruned['measured'], 1):.1f}x",
                    f"{med['exhaustive'] * 1e3:.3f}" if med else "-",
                    f"{med['default'] * 1e3:.3f}" if med else "-",
                    (f"**{ratio:.3f}**" + ("" if ratio <= WITHIN else " (over 2%)"))
                    if ratio
                    else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help=f"scaling subjects ({' '.join(ORDER)})")
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument("--folder", default="/tmp/partune-scale", help="ONNX exports, stores and plans")
    p.add_argument("--out", default=str(RESULTS / "pruning.md"))
    args = p.parse_args(argv)
    args.peers, args.timeout = "none", None
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = Path(args.out).with_suffix(".json")
    rows = {r["model"]: r for r in json.loads(raw.read_text())} if raw.exists() else {}
    for name in args.models:
        rows[name] = bench(name, args, folder)
        ordered = sorted(
            rows.values(), key=lambda r: ORDER.index(r["model"]) if r["model"] in ORDER else 99
        )
        raw.write_text(json.dumps(ordered, indent=1))
        Path(args.out).write_text(HEADER + table(ordered) + "\n")
    return 0


HEADER = f"""# The default search against the exhaustive one

`experiments/bench_pruning.py` on the scaling subjects (BERT-768 encoders, seq 128; a full-size
ResNet-50 and EfficientNet-B0), all four backends, 1 thread, `--peers none`. *exhaustive*: \
`--cost-model off` on a
fresh store, every candidate measured. *default*: the default search (`--cost-model auto`) on a
copy of the benchmark's store ({STORE.relative_to(ROOT)}, its cost model beside it; the subject is
in neither), as for a user who tuned other models before. Regions a subject shares with a benchmark
model are read from that store: EfficientNet-B0's default search reused 543 measurements of the
benchmark's 0.75-width efficientnet, the BERT subjects 36 and ResNet-50 21. Plans timed in one \
process,
interleaved (21 rounds, medians); the goal is *default / exhaustive* at most {WITHIN}.

"""


if __name__ == "__main__":
    raise SystemExit(main())
