"""Mixed precision under an accuracy budget (issue 34): int8, bf16 and f32 regions against the
f32 peers and the int8 peers the budget allows.

For each model, ``partune tune --precision int8 --tolerance REL`` is run exactly as a user
runs it: regions may compute in int8 (onnxruntime, OpenVINO; QDQ form), in bf16 where the CPU
has it, or in f32, and the emitted plan's relative error against f32 stays within REL. Its
interleaved verdict then holds, timed in one run: the finalist plans, the f32 peers
(onnxruntime and OpenVINO on the model as given, torch.compile) and the int8 peers
(onnxruntime ``quantize_static`` on the same file, OpenVINO through NNCF ``quantize``), each
int8 peer with its error. Writes experiments/results/precision.md (and .json, rows merged
across runs): per model the emitted plan, its time and error, its makeup (share of measured
isolated time per backend and precision), the fastest f32 peer, each int8 peer's time and
error (marked when over budget), the plan's ratio to the fastest f32 peer and to the fastest
peer within budget (f32 peers, and int8 peers whose error is at most REL), search seconds and
measurements made; then geomeans over models and the slowest model. The header names the
CPU, its reduced-precision instruction set, the threads, the tolerance and the commit.

    python experiments/bench_precision.py [MODEL ...] [--tolerance 1e-2] [--threads 1|all]
    python experiments/bench_precision.py --held-out      # experiments/architectures.py HELD_OUT
    python experiments/bench_precision.py --metric top1   # the classifiers, top-1 agreement

``--metric top1`` judges the classifiers (``CLASSIFIERS``) as their users do, by top-1 agreement
with f32, on seeded samples written as the user's own (``--calibration``/``--validation``
files, drawn like the model's inputs): an agreement rate needs more rows than the two synthetic
sets the default metric is judged on. It writes precision_top1.md.

A run of some models replaces their rows in the .json and keeps the others'; each row says
when and at which commit it was measured. The per-model stdout lands in precision/MODEL.txt.
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

from experiments.bench_vs_peers import (  # noqa: E402
    EXPORTS,
    RESULTS,
    _commit,
    _export,
    merged,
    row_isa,
)

DEFAULT_MODELS = [
    "bert-small",
    "gpt2-small",
    "vit-small",
    "convnext-small",
    "squeezenet1_1",
    "mobilenet_v3_small",
    "densenet",
    "distilbert",
    "whisper_encoder",
    "wav2vec2",
    "deberta",
]
# One column each; labels say which graph ran. The bf16 peers are there only where the CPU has
# bf16 instructions ("-" elsewhere).
REDUCED_PEERS = (
    "onnxruntime int8",
    "openvino int8",
    "openvino int8 accuracy-control",
    "openvino bf16",
    "torch.compile bf16",
)
# The models whose first output is class logits, judged by top-1 agreement under --metric top1.
CLASSIFIERS = (
    "squeezenet1_1",
    "mobilenet_v3_small",
    "densenet",
    "convnext-small",
    "vit-small",
    "inception",
)
CALIBRATION_SAMPLES = 16  # --metric top1: drawn like the model's inputs, seeds 100..
VALIDATION_SAMPLES = 100  # seeds 1000..: one top-1 flip in 100 is the budget of 0.01
METRIC_TEXT = {
    "rel": "relative error vs f32, worst output",
    "top1": f"top-1 disagreement with f32 over {VALIDATION_SAMPLES} validation samples",
}
STATS = re.compile(r"search ([\d.]+) s; candidates (\d+); measurements made (\d+)")


def _makeup(regions: list[dict]) -> dict[str, float]:
    """Share of the plan's measured isolated time per 'backend precision' (equal shares when
    no region carries a cost, as in a model-file plan)."""
    costs: dict[str, float] = {}
    for r in regions:
        key = f"{r['scope']['backend']} {r['scope'].get('precision') or 'f32'}"
        costs[key] = costs.get(key, 0.0) + (r.get("cost_s") or 0.0)
    total = sum(costs.values())
    return {k: (v / total if total else 1 / len(costs)) for k, v in costs.items()}


def write_samples(spec: str, flags: list[str], folder: Path) -> list[str]:
    """Seeded calibration and validation files for ``spec``, drawn like its inputs and saved as
    a user saves theirs (one .npz per set, samples stacked on a leading axis per input name),
    and the ``partune tune`` flags that pass them."""
    import numpy as np

    from partune.core import draw_like
    from partune.frontend import load

    shapes = {}
    for name, dims in (f.split("=") for f in flags if "=" in f):
        shapes[name] = tuple(int(d) for d in dims.split(","))
    model = load(spec, shapes or None)
    names = [p.name for p in model.mod["main"].params]
    out = []
    for kind, count, first in (
        ("calibration", CALIBRATION_SAMPLES, 100),
        ("validation", VALIDATION_SAMPLES, 1000),
    ):
        samples = [draw_like(model.inputs, seed) for seed in range(first, first + count)]
        path = folder / f"{Path(spec).stem}.{kind}.npz"
        np.savez(path, **{n: np.stack([s[i] for s in samples]) for i, n in enumerate(names)})
        out += [f"--{kind}", str(path)]
    return out


def tune_int8(spec: str, flags: list[str], args, out: Path) -> dict:
    """One ``partune tune --precision int8`` run, read back from its plan and its stdout."""
    from partune.core import instruction_set

    samples = []
    if args.metric != "rel":
        samples = [*write_samples(spec, flags, out.parent), "--metric", args.metric]
    cmd = [
        *(sys.executable, "-m", "partune.cli", "--threads", str(args.threads), *flags),
        *("tune", spec, "--backends", args.backends, "--storage", args.storage),
        *("--timeout", args.timeout),
        *("--refine-trials", "8"),  # the default search's fixed work: the timeout only bounds it
        *("--precision", "int8", "--tolerance", str(args.tolerance), "-o", str(out)),
        *(("--retry-failed",) if args.retry_failed else ()),
        *(("--peers", args.peers) if args.peers else ()),
        *samples,
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row: dict = {
        "model": Path(spec).stem if spec.endswith(".onnx") else spec,
        "wall_s": time.monotonic() - start,
        "measured": f"{time.strftime('%Y-%m-%d %H:%M')} at {_commit()}",
        "isa": instruction_set(),
    }
    folder = Path(args.out).with_suffix("")  # precision.md -> precision/MODEL.txt
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{row['model']}.txt").write_text(done.stdout + done.stderr[-4000:])
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    plan = json.loads(out.read_text())
    notes = plan["notes"]
    stats = STATS.search(done.stdout)
    return row | {
        "chosen_as": notes["chosen_as"],
        "kind": notes.get("kind", "plan"),
        "verdict": notes.get("verdict_median_s", {}),
        "rel_errors": notes.get("rel_errors", {}),
        "peers": notes.get("peers", []),
        "peers_unavailable": notes.get("peers_unavailable", {}),
        "plan_error": notes.get("rel_error"),  # absent: the plan computes in f32
        "makeup": _makeup(plan["regions"]),
        "search_s": float(stats.group(1)) if stats else None,
        "measurements": int(stats.group(3)) if stats else None,
    }


def _reduced(r: dict, peer: str) -> bool:
    """Whether a peer trades accuracy (int8 or bf16): it has an error, or its label says so."""
    return peer in r["rel_errors"] or any(p in peer for p in (" int8", " bf16"))


def ratios(r: dict, tolerance: float) -> tuple[float | None, float | None, float | None]:
    """The fastest f32 peer's median, and the plan's speed-up over it and over the fastest peer
    within budget (f32 peers, and reduced ones whose error is at most ``tolerance``)."""
    v = r["verdict"]
    plan_s = v.get(r["chosen_as"])
    timed = [p for p in r["peers"] if p in v]
    f32 = [v[p] for p in timed if not _reduced(r, p)]
    allowed = f32 + [
        v[p] for p in timed if _reduced(r, p) and r["rel_errors"].get(p, math.inf) <= tolerance
    ]
    return (
        min(f32, default=None),
        min(f32) / plan_s if f32 and plan_s else None,
        min(allowed) / plan_s if allowed and plan_s else None,
    )


def _ms(v: float | None) -> str:
    return f"{v * 1e3:.3f}" if v else "-"


def _x(v: float | None, bold: bool = False) -> str:
    return "-" if v is None else f"**{v:.2f}x**" if bold else f"{v:.2f}x"


def _peer_cell(r: dict, prefix: str, tolerance: float) -> str:
    """A reduced-precision peer's median and error, marked when over budget ("-": not a peer
    here)."""
    peer = next((p for p in r["peers"] if p.startswith(f"{prefix} (")), None)
    if peer is None:
        return "-"
    if peer not in r["verdict"]:
        return "unavailable"
    error = r["rel_errors"].get(peer)
    if error is None:
        return f"{_ms(r['verdict'][peer])} (error ?)"
    over = ", over budget" if error > tolerance else ""
    return f"{_ms(r['verdict'][peer])} ({error:.1e}{over})"


def machine(threads: int, tolerance: float, isas: list[str], metric: str = "rel") -> str:
    from partune.core import cpu_name, instruction_set

    return (
        f"machine: {cpu_name()} ({os.cpu_count()} cores), instruction set **{instruction_set()}**; "
        f"{threads} thread(s); tolerance {tolerance:g} ({METRIC_TEXT[metric]}); "
        f"commit {_commit()}. Rows by instruction set (the `measured` column): "
        + ", ".join(f"**{isa}**" for isa in isas)
    )


def table(rows: list[dict], tolerance: float, threads: int, metric: str = "rel") -> str:
    head = [
        "model",
        "emitted plan",
        "plan ms",
        "plan error",
        "makeup (share of isolated time)",
        "fastest f32 peer ms",
        *[f"{k} ms (error)" for k in REDUCED_PEERS],
        "x fastest f32 peer",
        "x fastest peer within budget",
        "search s",
        "measurements",
        "measured",
    ]
    isas = sorted({row_isa(r) for r in rows})
    lines = [
        machine(threads, tolerance, isas, metric),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    done: list[tuple[str, float, float]] = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        f32_s, vs_f32, vs_allowed = ratios(r, tolerance)
        makeup = ", ".join(
            f"{k} {share:.0%}" if share >= 0.005 or not share else f"{k} <1%"
            for k, share in sorted(r["makeup"].items(), key=lambda kv: -kv[1])
        )
        if r.get("kind") == "model file":
            makeup += " (the model's own file)"
        error = r.get("plan_error")
        cells = [
            r["model"],
            r["chosen_as"],
            _ms(r["verdict"].get(r["chosen_as"])),
            f"{error:.1e}" if error is not None else "f32",
            makeup,
            _ms(f32_s),
            *[_peer_cell(r, prefix, tolerance) for prefix in REDUCED_PEERS],
            _x(vs_f32),
            _x(vs_allowed, bold=True),
            f"{r['search_s']:.0f}" if r.get("search_s") else "-",
            str(r.get("measurements", "-")),
            f"{r.get('measured', '-')} on {row_isa(r)}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if vs_f32 and vs_allowed:
            done.append((r["model"], vs_f32, vs_allowed, row_isa(r)))
    for isa in isas:  # one machine's numbers are not another's: a geomean per instruction set
        lines += ["", _geomean([d for d in done if d[3] == isa], isa)] if done else []
    return "\n".join(lines)


def _geomean(done: list[tuple[str, float, float, str]], isa: str) -> str:
    if not done:
        return f"{isa}: no model measured"
    geo = [math.exp(sum(math.log(d[i]) for d in done) / len(done)) for i in (1, 2)]
    worst = min(done, key=lambda d: d[2])
    return (
        f"{isa}: geomean over {len(done)} models: **{geo[0]:.2f}x** the fastest f32 peer, "
        f"**{geo[1]:.2f}x** the fastest peer within budget; slowest model {worst[0]} "
        f"({worst[2]:.2f}x the fastest peer within budget, {worst[1]:.2f}x the fastest f32 peer)"
    )


PREAMBLE = (
    "batch 1, backends {backends}, `partune tune --precision int8 --tolerance {tol:g}`: "
    "regions may run int8 (onnxruntime, OpenVINO; QDQ, weights per channel, activations "
    "calibrated once), bf16 where the CPU has it, or f32. All timings are medians of one "
    "interleaved verdict per model. plan error: the emitted plan's relative error against f32 "
    "(worst output, on the model's inputs and on a held-out seeded set); f32: no reduced region. "
    "makeup: share of the plan's measured isolated region time per backend and precision. "
    "Peers run on the model as given (the .onnx file; a torch.onnx.export for zoo models): f32 "
    "onnxruntime, OpenVINO and torch.compile; onnxruntime int8 (quantize_static) and OpenVINO "
    "int8 (NNCF quantize), and NNCF quantize_with_accuracy_control at the same budget (layers "
    "reverted to f32 by sensitivity until the budget holds), each with its error; over budget a "
    "peer is no bar. x fastest peer "
    "within budget: against the fastest of the f32 peers and the int8 peers within budget "
    "(> 1: the plan is faster). An emitted plan named after a peer is the model's own file "
    "under that library (no partitioned plan beat it)."
)

TOP1_NOTE = (
    f" **Judged by top-1 agreement** (`--metric top1`): each classifier is tuned with "
    f"`--calibration` ({CALIBRATION_SAMPLES} samples) and `--validation` "
    f"({VALIDATION_SAMPLES} samples), seeded draws like its inputs written as .npz files; every "
    "error here (plan and peers, NNCF's accuracy control included) is the share of validation "
    "samples whose top-1 class differs from f32's, and the budget allows one in a hundred."
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", help=f"default: {' '.join(DEFAULT_MODELS)}")
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument("--tolerance", type=float, default=1e-2)
    p.add_argument(
        "--metric",
        choices=("rel", "top1"),
        default="rel",
        help="rel: every model on synthetic inputs; top1: the classifiers only, on "
        f"{VALIDATION_SAMPLES} seeded validation samples (writes precision_top1.md)",
    )
    p.add_argument(
        "--storage",
        help="measurement store (default: results/precision.db; with --held-out "
        "results/precision_held_out.db)",
    )
    p.add_argument("--timeout", default="15m", help="per-model limit on measuring candidates")
    p.add_argument("--threads", default="1", help="threads for every contender: N, or 'all'")
    p.add_argument(
        "--out",
        help="report (default: results/precision.md; at more threads precision_all_cores.md; "
        "with --held-out precision_held_out[_all_cores].md)",
    )
    p.add_argument("--held-out", action="store_true", help="run exactly architectures.HELD_OUT")
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="take stored failures again (a peer that failed before a fix)",
    )
    p.add_argument("--exporter", choices=("legacy", "dynamo"), default="legacy")
    p.add_argument(
        "--peers",
        help="partune tune's --peers (default: its own, with every int8 peer of the libraries); "
        "naming int8 peers times exactly those, e.g. to leave out NNCF's accuracy control on "
        "a model where it runs for hours (the report says which peers ran)",
    )
    args = p.parse_args(argv)
    from experiments.architectures import HELD_OUT

    if args.held_out and args.models:
        p.error("--held-out runs exactly the held-out set; name no models with it")
    if held := [m for m in args.models if m in HELD_OUT]:
        p.error(f"{', '.join(held)}: held out, run only with --held-out")
    args.threads = os.cpu_count() or 1 if args.threads == "all" else int(args.threads)
    suffix = "_held_out" if args.held_out else ""
    cores = "" if args.threads == 1 else "_all_cores"
    metric = "" if args.metric == "rel" else f"_{args.metric}"
    args.out = args.out or str(RESULTS / f"precision{suffix}{metric}{cores}.md")
    args.storage = args.storage or f"sqlite:///{RESULTS / f'precision{suffix}.db'}"
    models = list(HELD_OUT) if args.held_out else args.models or DEFAULT_MODELS
    if args.metric == "top1":
        if others := [m for m in args.models if m not in CLASSIFIERS]:
            p.error(f"{', '.join(others)}: not a classifier; --metric top1 runs {CLASSIFIERS}")
        models = [m for m in models if m in CLASSIFIERS]
    raw = Path(args.out).with_suffix(".json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(raw.read_text()) if raw.exists() else []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            exported = name in (*EXPORTS, *HELD_OUT)
            spec, flags = _export(name, Path(tmp), args.exporter) if exported else (name, [])
            rows.append(tune_int8(spec, flags, args, Path(tmp) / f"{name}.plan.json"))
            every = merged(earlier, rows)
            text = table(every, args.tolerance, args.threads, args.metric)
            print(f"\n{text}", flush=True)
            raw.write_text(json.dumps(every, indent=1))
            budget = "relative-error" if args.metric == "rel" else "top-1 disagreement"
            Path(args.out).write_text(
                f"# Mixed precision within a {budget} budget of {args.tolerance:g}"
                + (" (held-out architectures)" if args.held_out else "")
                + f"\n\n{args.threads} thread(s), "
                + PREAMBLE.format(backends=args.backends, tol=args.tolerance)
                + (TOP1_NOTE if args.metric == "top1" else "")
                + (
                    f" Peers named for this run: {args.peers}; one not named is not timed (-)."
                    if args.peers
                    else ""
                )
                + f"\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
