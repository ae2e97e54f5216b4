"""Benchmark: every single-backend plan against the usual peers, per zoo model.

Usage: python experiments/bench_single_backends.py [MODEL ...] [--threads N] [--out FILE]
Writes a Markdown report (default experiments/results/single_backends.md): one table per
model, every contender measured in the same run, ratios to the fastest, with the CPU
model and load recorded beside them.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_MODELS = [
    "resnet50-small",
    "mobilenet_v2-small",
    "convnext-small",
    "vit-small",
    "bert-small",
    "gpt2-small",
]


def main() -> int:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--peers", default="torch,torch.compile,onnxruntime")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "single_backends.md"))
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    from partune.backends import registry
    from partune.bench import bench, format_table
    from partune.frontend.models import load

    registry.set_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    report = [
        f"# Single-backend plans vs peers ({time.strftime('%Y-%m-%d')})",
        "",
        (
            f"CPU: {cpu}, {os.cpu_count()} cores, {args.threads} thread(s); batch 1; median of 7 "
            "samples."
        ),
        "",
    ]
    for name in args.models:
        model = load(name)
        rows = bench(model, peers=args.peers.split(","), threads=args.threads, progress=True)
        table = format_table(rows)
        print(f"\n{name}\n{table}", flush=True)
        report += [
            f"## {name} ({len(model.graph)} nodes, load {os.getloadavg()[0]:.2f})",
            "",
            table,
            "",
        ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(report))
    print(f"\nreport written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
