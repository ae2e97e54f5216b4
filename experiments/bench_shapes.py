"""The shapes users serve (issue 35): one job tuned at several shapes, deployed with dispatch.

For each model, an ONNX export with symbolic axes (as a user's file declares them) is tuned
exactly as a user runs it, ``partune tune FILE --shapes ...`` (one plan per point, one store),
and, in a fresh store (and cost model) of its own, at its largest point alone: the buckets'
searches share what they can, so all of them should take at most about twice the largest alone.
Each point's verdict (the plan against onnxruntime and OpenVINO on the file at that shape,
interleaved) is read from the job's summary. The plan file is exported, and the deployed
artifact is run, in a process of its own, at shapes between and beyond the points; each output
is compared with onnxruntime on the file at the same shape. Writes
experiments/results/shapes.md (and .json). Rows are merged with the earlier runs' (each says
when and at which commit).

    python experiments/bench_shapes.py [MODEL ...] [--threads 1|all] [--timeout 8m]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_vs_peers import RESULTS, _commit, _export, merged, row_isa  # noqa: E402

# model -> (--shapes, --pad-safe, the axis the check varies, the sizes the artifact is run at)
MODELS = {
    "distilbert": ("sequence=32,128,384", "", "sequence", (16, 32, 100, 128, 300, 384)),
    "llama": ("sequence=32,128,384", "sequence", "sequence", (16, 32, 100, 128, 300, 384)),
    "squeezenet1_1": ("batch=1,8", "batch", "batch", (1, 4, 8, 16)),
}

CHECK = r"""
import json, sys
import numpy as np, onnxruntime as ort
import partune.deployed
deployed, model, axis = sys.argv[1:4]
sizes, ranges = json.loads(sys.argv[4]), json.loads(sys.argv[5])
d = partune.deployed.load(deployed)
sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
rows = []
for n in sizes:
    feeds = {}
    for i in sess.get_inputs():
        shape = [n if p == axis else (1 if isinstance(p, str) else p) for p in i.shape]
        if "int" in i.type:
            lo, hi = ranges.get(i.name, (0, 100))
            feeds[i.name] = rng.integers(lo, hi + 1, shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    before = dict(d.stats)
    got = d(*feeds.values())
    want = sess.run(None, feeds)
    err = max(
        float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
        for g, w in zip(got, want)
    )
    went = [k for k, v in d.stats.items() if v != before.get(k, 0)]
    rows.append({"size": n, "max_rel_err": err, "route": "+".join(sorted(went))})
print(json.dumps(rows))
"""


def _run(cmd: list[str], log: Path) -> tuple[int, float]:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr[-20000:])
    return done.returncode, time.monotonic() - start


def _cli(args, *rest: str, shapes: tuple[str, ...] = ()) -> list[str]:
    """``partune`` at the bench's threads; ``shapes``: --input-shape values (before the
    subcommand, where the global flags go)."""
    flags = [f"--input-shape={s}" for s in shapes]
    return [sys.executable, "-m", "partune.cli", "--threads", str(args.threads), *flags, *rest]


def _tune(spec: str, args, db: Path, out: Path, *flags: str) -> list[str]:
    return [
        "tune",
        spec,
        "--backends",
        args.backends,
        "--storage",
        f"sqlite:///{db}",
        "--timeout",
        args.timeout,
        "-o",
        str(out),
        *flags,
    ]


def _input_ranges(name: str) -> dict[str, tuple[int, int]]:
    """The integer inputs' value ranges of the architecture's own example (token ids)."""
    from experiments.architectures import get

    arch = get(name)
    _, inputs = arch.build()
    return {
        n: (int(t.min()), int(t.max()))
        for n, t in zip(arch.input_names, inputs, strict=True)
        if not t.is_floating_point()
    }


def _points(plan: Path) -> list[dict]:
    """Each bucket's verdict, read from the plan file: the plan's median and each peer's."""
    from partune.core import load_plans, point_label

    plans = load_plans(plan)
    rows = []
    for bucket, span in zip(plans.buckets, plans.spans(), strict=True):
        notes = bucket.plan.notes
        times = notes.get("verdict_median_s", {})
        rows.append(
            {
                "point": point_label(bucket.point),
                "serves": span,
                "plan": notes.get("chosen_as"),
                "plan_ms": times.get(notes.get("chosen_as"), 0.0) * 1e3,
                "peers_ms": {p: times[p] * 1e3 for p in notes.get("peers", []) if p in times},
                "x_best_peer": notes.get("speedup_vs_best_peer"),
            }
        )
    return rows


def bench_one(name: str, args, folder: Path, logs: Path) -> dict:
    from partune.core import instruction_set
    from partune.frontend import read_file_shapes

    shapes, pad, axis, sizes = MODELS[name]
    spec, _ = _export(name, folder)
    plan = folder / f"{name}.plan.json"
    flags = ["--shapes", shapes] + (["--pad-safe", pad] if pad else [])
    code, all_s = _run(
        _cli(args, *_tune(spec, args, folder / f"{name}.db", plan, *flags)), logs / f"{name}.txt"
    )
    if code:
        return {"model": name, "error": f"tune failed: see shapes/{name}.txt"}
    largest = int(shapes.split("=")[1].split(",")[-1])
    alone = tuple(
        f"{n}="
        + ",".join(str(largest if d == axis else 1 if isinstance(d, str) else d) for d in dims)
        for n, dims in read_file_shapes(spec).inputs
    )
    code, alone_s = _run(
        _cli(
            args,
            *_tune(spec, args, folder / f"{name}.alone.db", folder / f"{name}.alone.json"),
            shapes=alone,
        ),
        logs / f"{name}.alone.txt",
    )
    deploy = folder / f"{name}.deploy"
    _run(
        _cli(args, "export", spec, "--plan", str(plan), "-o", str(deploy)),
        logs / f"{name}.export.txt",
    )
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            CHECK,
            str(deploy),
            spec,
            axis,
            json.dumps(sizes),
            json.dumps(_input_ranges(name)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return {
        "model": name,
        "shapes": shapes,
        "points": _points(plan),
        "all_s": all_s,
        "alone_s": alone_s if code == 0 else None,
        "served": json.loads(check.stdout.strip().splitlines()[-1])
        if check.returncode == 0
        else [],
        "check_error": check.stderr.strip().splitlines()[-1:] if check.returncode else None,
        "measured": time.strftime("%Y-%m-%d %H:%M") + f" at {_commit()}",
        "isa": instruction_set(),
    }


def table(rows: list[dict], threads: int) -> str:
    from partune.core import cpu_name, instruction_set

    lines = [
        f"machine: {cpu_name()} ({os.cpu_count()} cores), instruction set **{instruction_set()}**;"
        f" {threads} thread(s); commit {_commit()}",
        "",
        "Per model and tuned point: the verdict of `partune tune --shapes` at that shape "
        "(medians, interleaved; the peers run the exported file at the same shape).",
        "",
        "| model | point | serves | emitted plan | plan ms | peers ms | x best peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} | | | | | |")
            continue
        for p in r["points"]:
            peers = ", ".join(f"{k.split(' (')[0]} {v:.3f}" for k, v in p["peers_ms"].items())
            ratio = f"{p['x_best_peer']:.2f}x" if p["x_best_peer"] else "-"
            lines.append(
                f"| {r['model']} | {p['point']} | {p['serves']} | {p['plan']} | "
                f"{p['plan_ms']:.3f} | {peers} | {ratio} |"
            )
    lines += [
        "",
        "Search cost, and the deployed artifact served in a fresh process at sizes between and "
        "beyond the points, against onnxruntime on the file at each size (max relative error; "
        "route: where the dispatch sent the call):",
        "",
        "| model | all buckets s | largest point alone s | ratio | served: size err (route) "
        "| measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        alone = r.get("alone_s")
        served = (
            ", ".join(f"{s['size']} {s['max_rel_err']:.0e} ({s['route']})" for s in r["served"])
            or f"check failed: {r.get('check_error')}"
        )
        took = f"{alone:.0f} | {r['all_s'] / alone:.2f}x" if alone else "- | -"
        on = f"{r.get('measured', '-')} on {row_isa(r)}"
        lines.append(f"| {r['model']} | {r['all_s']:.0f} | {took} | {served} | {on} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", help=f"default: {' '.join(MODELS)}")
    p.add_argument("--backends", default="tvm,onnxruntime,openvino")
    p.add_argument("--timeout", default="8m", help="each bucket's search budget")
    p.add_argument("--threads", default="1", help="N, or 'all'")
    args = p.parse_args(argv)
    args.threads = os.cpu_count() or 1 if args.threads == "all" else int(args.threads)
    suffix = "" if args.threads == 1 else "_all_cores"
    out = RESULTS / f"shapes{suffix}.md"
    logs = RESULTS / "shapes"
    logs.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".json")
    earlier = json.loads(raw.read_text()) if raw.exists() else []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models or list(MODELS):
            rows.append(bench_one(name, args, Path(tmp), logs))
            every = merged(earlier, rows)
            text = table(every, args.threads)
            print(f"\n{text}", flush=True)
            raw.write_text(json.dumps(every, indent=1))
            out.write_text(
                "# One job over the shapes users serve: a plan per bucket, deployed with "
                f"dispatch\n\nbackends {args.backends}; each bucket's search budget "
                f"{args.timeout}.\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
