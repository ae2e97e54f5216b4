"""How much any f32 plan could gain over the libraries on a model, before searching: its headroom.

Every plan computes the model's convolutions and matrix products, whatever backend runs
them, and no f32 kernel runs them faster than the core's GEMM peak. So with the faster of
onnxruntime and OpenVINO on the user's file as the bar:

- ``floor``: the model's convolution and matmul FLOPs (after import: work on constants only
  is folded) at that peak. No f32 plan doing that arithmetic takes less time;
- ``ceiling``: bar / floor, the most such a plan could gain;
- ``rest_free``: bar / the time OpenVINO spends in its GEMM-class kernels (from its per-layer
  counters): what a plan would gain whose GEMMs ran as fast as OpenVINO's and
  whose every other op, border and call took no time. Only where OpenVINO is the bar, as
  its GEMM speed bounds a plan only where no library runs the model faster;
- ``bound``: the smaller, since both are upper bounds.

Near 1.0x, a longer search cannot help: the library already runs the arithmetic at about
the core's speed, and only less arithmetic (Winograd, lower precision) could do better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# OpenVINO's names, in its per-layer counters, for kernels that are convolutions or GEMMs.
GEMM_KERNELS = frozenset(
    {
        "Convolution",
        "GroupConvolution",
        "FullyConnected",
        "MatMul",
        "Deconvolution",
        "ConvolutionBackpropData",
        "GroupConvolutionBackpropData",
    }
)
_CONVS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d")
_TRANSPOSED = ("relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose")


def gemm_flops(func) -> float:
    """FLOPs (2 per multiply-add) of the matmuls and convolutions of a static-shaped Relax
    function."""
    import tvm
    from tvm import relax

    from partune.core import known_shape, main_bindings

    total = 0.0
    for b in main_bindings(func):
        call = b.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)):
            continue
        name = call.op.name
        if name not in ("relax.matmul", *_CONVS, *_TRANSPOSED):
            continue
        out, x, w = (
            known_shape(b.var.ty),
            known_shape(call.args[0].ty),
            known_shape(call.args[1].ty),
        )
        if out is None or x is None or w is None:
            continue
        if name == "relax.matmul":  # [..., M, K] @ [..., K, N]: K products per output
            total += 2 * math.prod(out) * x[-1]
        elif name in _CONVS:  # weight [O, I/groups, k...]: that many products per output
            total += 2 * math.prod(out) * math.prod(w[1:])
        else:  # weight [I, O/groups, k...]: each input element reaches that many outputs
            total += 2 * math.prod(x) * math.prod(w[1:])
    return total


PEAK_SHAPE = (512, 2048, 2048)  # M, K, N: large enough that OpenVINO's f32 GEMM runs at its best


def peak_gemm(threads: int):
    """A call of OpenVINO's f32 [M x K] @ [K x N] (``PEAK_SHAPE``) on ``threads`` threads: timed
    beside the libraries, its FLOP rate is the core's f32 GEMM peak under the same conditions."""
    import openvino as ov
    from openvino import opset13 as ops

    from partune.backends import compile_config, openvino_core

    m, k, n = PEAK_SHAPE
    a = ops.parameter([m, k], np.float32)
    w = ops.constant(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32))
    request = (
        openvino_core()
        .compile_model(
            ov.Model([ops.matmul(a, w, False, False)], [a]), "CPU", compile_config(threads)
        )
        .create_infer_request()
    )
    request.set_input_tensor(ov.Tensor(np.ones((m, k), np.float32)))
    return request.infer


def openvino_gemm_s(data: bytes, inputs: list[np.ndarray], threads: int, wall_s: float) -> float:
    """Seconds a run of OpenVINO on ``data`` spends in its GEMM-class kernels, from its per-layer
    counters, given its time per run without them (``wall_s``).

    Counters slow every layer a little and leave out the calls around the layers; so of the
    counted GEMM time and the GEMM share of counted time applied to ``wall_s``, the smaller
    (the bound it gives is then the looser).
    """
    import openvino as ov

    from partune.backends import compile_config, openvino_core, openvino_model

    config = compile_config(threads) | {"PERF_COUNT": True}
    request = (
        openvino_core()
        .compile_model(openvino_model(data, inputs), "CPU", config)
        .create_infer_request()
    )
    for i, a in enumerate(inputs):
        request.set_input_tensor(i, ov.Tensor(np.ascontiguousarray(a)))
    for _ in range(3):
        request.infer()
    runs, gemm_s, all_s = 20, 0.0, 0.0
    for _ in range(runs):
        request.infer()
        for p in request.get_profiling_info():
            all_s += p.real_time.total_seconds()
            gemm_s += p.real_time.total_seconds() if p.node_type in GEMM_KERNELS else 0.0
    return min(gemm_s / runs, gemm_s / all_s * wall_s) if all_s > 0 else math.nan


@dataclass(frozen=True)
class Headroom:
    """One model's headroom at one thread count (see the module docstring)."""

    model: str
    threads: int
    libraries_s: dict[str, float]  # library -> median seconds on the model's ONNX graph
    gflop: float
    peak_gflops: float
    openvino_gemm_s: float = math.nan  # nan where OpenVINO cannot read the file
    unavailable: dict[str, str] = field(default_factory=dict)  # library -> its one-line reason

    @property
    def bar(self) -> str:
        return min(self.libraries_s, key=self.libraries_s.get)

    @property
    def floor_s(self) -> float:
        return self.gflop / self.peak_gflops

    @property
    def ceiling(self) -> float:
        return self.libraries_s[self.bar] / self.floor_s if self.gflop > 0 else math.inf

    @property
    def rest_free(self) -> float:
        if self.bar != "openvino" or not self.openvino_gemm_s > 0:
            return math.nan
        return self.libraries_s["openvino"] / self.openvino_gemm_s

    @property
    def bound(self) -> float:
        return self.ceiling if math.isnan(self.rest_free) else min(self.ceiling, self.rest_free)


def measure(model, threads: int = 1) -> Headroom:
    """Time onnxruntime and OpenVINO on the model's ONNX graph (interleaved), count its GEMM
    FLOPs and OpenVINO's GEMM share, and time the core's peak beside them. Raises ``ModelFileError``
    when neither library can read the graph."""
    from partune.backends import ModelFileError, open_model_file
    from partune.runners import model_onnx, time_interleaved

    data = model_onnx(model)
    runs, unavailable = {}, {}
    for library in ("onnxruntime", "openvino"):
        try:
            runs[library] = open_model_file(library, data, model.inputs, threads).prepare(
                model.inputs
            )
        except ModelFileError as e:
            unavailable[library] = str(e)
    if not runs:
        raise ModelFileError(
            f"no library can run {model.name}'s ONNX graph: " + "; ".join(unavailable.values())
        )
    # The peak is timed in the same rounds: a neighbour's load or a frequency change then
    # touches it as it touches the libraries.
    timed = {
        label: m.median_s
        for label, m in time_interleaved(runs | {"peak": peak_gemm(threads)}, rounds=7).items()
    }
    peak_gflops = 2 * math.prod(PEAK_SHAPE) / timed.pop("peak") / 1e9
    gemm_s = (
        openvino_gemm_s(data, model.inputs, threads, timed["openvino"])
        if "openvino" in runs
        else math.nan
    )
    return Headroom(
        model.name,
        threads,
        timed,
        gemm_flops(model.mod["main"]) / 1e9,
        peak_gflops,
        gemm_s,
        unavailable,
    )


def describe(h: Headroom) -> str:
    """A few lines a person reads before deciding whether to start a search."""
    lines = [
        f"{h.model}: {h.threads} thread(s); "
        + ", ".join(
            f"{lib} {s * 1e3:.3f} ms"
            for lib, s in sorted(h.libraries_s.items(), key=lambda kv: kv[1])
        )
        + "".join(f"; {lib} unavailable ({why})" for lib, why in h.unavailable.items())
    ]
    lines.append(
        f"arithmetic  {h.gflop:.3f} GFLOP in convolutions and matmuls; this core's f32 GEMM peak "
        f"{h.peak_gflops:.0f} GFLOP/s: at least {h.floor_s * 1e3:.3f} ms for any f32 plan "
        f"(ceiling {h.ceiling:.2f}x {h.bar})"
    )
    if not math.isnan(h.rest_free):
        lines.append(
            f"openvino    {h.openvino_gemm_s * 1e3:.3f} ms of its time in GEMM kernels: "
            f"{h.rest_free:.2f}x if everything else (every other op, border and call) cost nothing"
        )
    verdict = (
        (
            "a search can hardly win here: "
            "the library already runs the arithmetic at about this core's speed"
        )
        if h.bound < 1.10
        else "there is room for a plan to win"
    )
    lines.append(f"headroom    at most {h.bound:.2f}x over {h.bar}: {verdict}")
    return "\n".join(lines)
