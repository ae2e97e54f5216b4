"""How much faster than the best library any f32 plan could be, per benchmark export.

``partune headroom`` per model (``partune/headroom.py`` defines the columns), over the
legacy export of every architecture, held-out ones too: the faster of onnxruntime and
OpenVINO on the file is the bar; floor = the model's convolution and matmul FLOPs at the
core's f32 GEMM peak; ceiling = bar / floor; rest free = bar / OpenVINO's time in its GEMM
kernels; bound = the smaller. A bound under the issue's 1.10x means no partitioning reaches
that bar on the model; only less arithmetic could (Winograd or Strassen, which no backend
here offers: see ``probe_winograd.py``). Writes experiments/results/headroom.md.

    python experiments/bench_headroom.py [MODEL ...] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"


def measure(name: str, folder: Path, threads: int):
    """The headroom of the architecture's legacy export, as a user would measure it."""
    from experiments.architectures import export_onnx, get
    from partune.frontend.models import load_onnx
    from partune.headroom import measure as headroom

    path = folder / f"{name}.onnx"
    export_onnx(name, path)
    arch = get(name)
    _, tensors = arch.build()
    shapes = {n: tuple(t.shape) for n, t in zip(arch.input_names, tensors, strict=True)}
    return headroom(load_onnx(path, shapes), threads)


def plan_ratios(threads: int) -> dict[str, float]:
    """Each model's emitted plan vs the best peer, from the last `make bench` reports at one
    thread, or at every core."""
    import json

    ratios = {}
    suffix = "" if threads == 1 else "_all_cores"
    for report in (f"vs_peers{suffix}.json", f"vs_peers_held_out{suffix}.json"):
        path = RESULTS / report
        if path.exists():
            ratios |= {row["model"]: row["speedup"] for row in json.loads(path.read_text())}
    return ratios


def report(rows: list, threads: int) -> str:
    ratios = plan_ratios(threads)
    lines = [
        "# Headroom: the most any f32 plan could gain over the faster library",
        "",
        f"{threads} thread(s), batch 1, the legacy export of each architecture, measured as "
        "`partune headroom FILE` does (`partune/headroom.py` defines the columns): bar = the "
        "faster of onnxruntime and OpenVINO on the file, timed interleaved; floor = the model's "
        "convolution and matmul FLOPs at this core's f32 GEMM peak (OpenVINO's [512x2048] @ "
        "[2048x2048]); ceiling = bar / floor; rest free = bar / OpenVINO's time in its GEMM "
        "kernels, where OpenVINO is the bar; bound = the smaller. plan: the emitted plan vs the "
        "best peer in the last `make bench` at as many threads (another run, another day).",
        "",
        "| model | bar | bar ms | GFLOP | peak GFLOP/s | floor ms | OpenVINO GEMM kernels ms "
        "| ceiling | rest free | bound | plan (make bench) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h in rows:
        rest = "-" if math.isnan(h.rest_free) else f"{h.rest_free:.2f}x"
        gemm = "-" if math.isnan(h.openvino_gemm_s) else f"{h.openvino_gemm_s * 1e3:.3f}"
        plan = f"{ratios[h.model]:.2f}x" if h.model in ratios else "-"
        lines.append(
            f"| {h.model} | {h.bar} | {h.libraries_s[h.bar] * 1e3:.3f} | {h.gflop:.2f} | "
            f"{h.peak_gflops:.0f} | {h.floor_s * 1e3:.3f} | {gemm} | {h.ceiling:.2f}x | {rest} | "
            f"**{h.bound:.2f}x** | {plan} |"
        )
    geo = math.exp(sum(math.log(h.bound) for h in rows) / len(rows))
    lines += [
        "",
        f"geomean of the bound over {len(rows)} models: **{geo:.2f}x**; "
        f"under 1.10x on {sum(h.bound < 1.10 for h in rows)} of them",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from experiments.architectures import HELD_OUT, names
    from partune.headroom import describe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "models", nargs="*", help="architectures (default: every export, held-out ones too)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "headroom.md"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models or [*names(), *HELD_OUT]:
            rows.append(measure(name, Path(tmp), args.threads))
            print(describe(rows[-1]), flush=True)
    Path(args.out).write_text(report(rows, args.threads))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
