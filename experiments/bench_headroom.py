"""How much faster than the best peer any f32 plan could be, per model: its headroom.

Every plan Partune can emit computes the model's convolutions and matrix products as the
peers do, only on other libraries or with other borders. None of them can run that
arithmetic faster than the core's f32 GEMM peak, measured here as OpenVINO's own f32
matmul on a large product. So per model, with the peers timed interleaved on the user's
file:

- ``floor``: the FLOPs of the model's convolutions and matmuls that read an input, at that
  peak; no f32 plan doing the same arithmetic takes less (element-wise work, reorders and
  calls only add to it);
- ``ceiling``: best peer / floor, the most such a plan could ever gain over the best peer;
- ``if the rest were free``: best peer / the time OpenVINO spends in its GEMM-class kernels
  (convolution, fully connected, matmul, deconvolution: their share of its per-layer
  counters, times its time on the file). A plan whose GEMMs ran only as fast as OpenVINO's
  (no other backend's run faster) and whose every other op, border and call took no time
  would gain that much. Attention that OpenVINO fuses into one "Subgraph" kernel counts as
  "the rest", so on transformers this overstates the gain;
- ``bound``: the smaller of the two, as both are upper bounds.

A bound under the issue's 1.10x bar means no partitioning reaches the bar on that model;
only less arithmetic could (Winograd or Strassen, which no backend here offers: see
``probe_winograd.py``). Writes experiments/results/headroom.md.

    python experiments/bench_headroom.py [MODEL ...] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"
# Names in OpenVINO's per-layer counters; attention fused into a "Subgraph" is left out.
GEMM_KERNELS = ("Convolution", "GroupConvolution", "FullyConnected", "MatMul", "Deconvolution",
                "ConvolutionBackpropData", "GroupConvolutionBackpropData")


def gemm_peak_flops(threads: int) -> float:
    """FLOP/s of OpenVINO's f32 [512x2048] @ [2048x2048] on ``threads`` threads, best of 5."""
    import openvino as ov
    from openvino import opset13 as ops

    from partune.backends.openvino_backend import _core, compile_config

    a = ops.parameter([512, 2048], np.float32)
    w = ops.constant(np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32))
    compiled = _core().compile_model(ov.Model([ops.matmul(a, w, False, False)], [a]), "CPU",
                                     compile_config(threads))
    request = compiled.create_infer_request()
    request.set_input_tensor(ov.Tensor(np.ones((512, 2048), np.float32)))
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            request.infer()
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * 512 * 2048 * 2048 / best


def gemm_flops(model) -> float:
    """Multiply-add FLOPs of the convolutions and matmuls of a static-shaped ``ov.Model`` that
    read an input: those on constants only (DeBERTa's relative positions) fold at compile."""
    from openvino.passes import ConstantFolding, Manager

    model = model.clone()
    passes = Manager()
    passes.register_pass(ConstantFolding())
    passes.run_passes(model)
    total = 0.0
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind not in ("Convolution", "GroupConvolution", "ConvolutionBackpropData",
                        "GroupConvolutionBackpropData", "MatMul"):
            continue
        out = list(op.get_output_partial_shape(0).to_shape())
        x = list(op.get_input_partial_shape(0).to_shape())
        w = list(op.get_input_partial_shape(1).to_shape())
        grouped = kind.startswith("Group")
        if kind == "MatMul":  # [..., M, K] or [..., K, M] (transposed): K = M*K / M
            k = math.prod(x[-2:]) // out[-2] if len(x) >= 2 and len(out) >= 2 else x[-1]
            total += 2 * math.prod(out) * k
        elif kind.endswith("BackpropData"):  # each input element reaches C_out/g * kernel outputs
            total += 2 * math.prod(x) * math.prod(w[2 if grouped else 1:])
        else:  # each output element sums C_in/g * kernel products
            total += 2 * math.prod(out) * math.prod(w[2 if grouped else 1:])
    return total


def openvino_profile(data: bytes, inputs: list[np.ndarray], threads: int) -> tuple[float, float]:
    """(FLOPs of its GEMM-class ops, the share of OpenVINO's layer time in its GEMM-class kernels).

    A share, not seconds: with its counters on, every layer runs a little slower.
    """
    import openvino as ov

    from partune.backends.openvino_backend import _core, compile_config

    core = _core()
    model = core.read_model(data)
    model.reshape({p: ov.PartialShape(list(a.shape)) for p, a in zip(model.inputs, inputs, strict=True)})
    flops = gemm_flops(model)
    config = compile_config(threads)
    config["PERF_COUNT"] = True
    request = core.compile_model(model, "CPU", config).create_infer_request()
    for i, a in enumerate(inputs):
        request.set_input_tensor(i, ov.Tensor(np.ascontiguousarray(a)))
    for _ in range(5):
        request.infer()
    gemm_s = all_s = 0.0
    for _ in range(20):
        request.infer()
        for p in request.get_profiling_info():
            all_s += p.real_time.total_seconds()
            gemm_s += p.real_time.total_seconds() if p.node_type in GEMM_KERNELS else 0.0
    return flops, gemm_s / all_s


def measure(name: str, folder: Path, threads: int, peak: float) -> dict:
    """The peers on the model's legacy export, interleaved, and its headroom."""
    from experiments.architectures import export_onnx, get
    from partune.backends.model_file import ModelFileError, open_model_file
    from partune.runners.timing import time_interleaved

    data = export_onnx(name, folder / f"{name}.onnx")
    _, tensors = get(name).build()
    inputs = [t.detach().numpy() for t in tensors]
    peers, unavailable = {}, {}
    for library in ("onnxruntime", "openvino"):
        try:
            peers[library] = open_model_file(library, data, inputs, threads).prepare(inputs)
        except ModelFileError as e:
            unavailable[library] = str(e)
    timed = {label: m.median_s for label, m in time_interleaved(peers, rounds=7).items()}
    best = min(timed, key=timed.get)
    row = {"model": name, "peers_s": timed, "unavailable": unavailable, "best_peer": best}
    if "openvino" in peers:
        flops, share = openvino_profile(data, inputs, threads)
        gemm_s = share * timed["openvino"]
        row |= {"gflop": flops / 1e9, "floor_s": flops / peak, "ov_gemm_s": gemm_s,
                "ceiling": timed[best] / (flops / peak)}
        # OpenVINO's GEMM speed bounds a plan only where no peer runs the model faster.
        row["rest_free"] = timed[best] / gemm_s if best == "openvino" else math.nan
        row["bound"] = min(row["ceiling"], row["rest_free"]) if best == "openvino" else row["ceiling"]
    return row


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


def report(rows: list[dict], threads: int, peak: float) -> str:
    ratios = plan_ratios(threads)
    lines = [
        "# Headroom: the most any f32 plan could gain over the best peer",
        "",
        f"{threads} thread(s), batch 1, the legacy export of each architecture "
        "(`experiments/bench_headroom.py`, whose docstring defines the columns). Peers timed "
        f"interleaved on the file. This core's f32 GEMM peak: **{peak / 1e9:.0f} GFLOP/s** "
        "(OpenVINO's [512x2048] @ [2048x2048]). floor: the model's convolution and matmul FLOPs "
        "at that peak. ceiling = best peer / floor. rest free = best peer / OpenVINO's time in "
        "its GEMM-class kernels, where OpenVINO is the best peer. bound = the smaller. plan: the emitted plan vs the best peer "
        "in the last `make bench` at as many threads (another run, another day).",
        "",
        "| model | best peer | peer ms | GFLOP | floor ms | OpenVINO GEMM kernels ms | their FLOP/s x peak "
        "| ceiling | rest free | bound | plan (make bench) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["model"], r["best_peer"], f"{r['peers_s'][r['best_peer']] * 1e3:.3f}"]
        if "bound" in r:
            cells += [f"{r['gflop']:.2f}", f"{r['floor_s'] * 1e3:.3f}", f"{r['ov_gemm_s'] * 1e3:.3f}",
                      f"{r['floor_s'] / r['ov_gemm_s']:.2f}", f"{r['ceiling']:.2f}x",
                      f"{r['rest_free']:.2f}x".replace("nanx", "-"),
                      f"**{r['bound']:.2f}x**"]
        else:
            cells += ["-"] * 7
        cells.append(f"{ratios[r['model']]:.2f}x" if r["model"] in ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    bounds = [r["bound"] for r in rows if "bound" in r]
    if bounds:
        geo = math.exp(sum(map(math.log, bounds)) / len(bounds))
        lines += ["", f"geomean of the bound over {len(bounds)} models: **{geo:.2f}x**; "
                  f"under 1.10x on {sum(b < 1.10 for b in bounds)} of them"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from experiments.architectures import HELD_OUT, names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="architectures (default: every export, held-out ones too)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "headroom.md"))
    args = parser.parse_args(argv)
    models = args.models or [*names(), *HELD_OUT]
    peak = gemm_peak_flops(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            rows.append(measure(name, Path(tmp), args.threads, peak))
            r = rows[-1]
            print(f"{name}: best peer {r['best_peer']} {r['peers_s'][r['best_peer']] * 1e3:.3f} ms, "
                  f"bound {r.get('bound', math.nan):.2f}x", flush=True)
    Path(args.out).write_text(report(rows, args.threads, peak))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
