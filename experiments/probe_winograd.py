"""Can less arithmetic beat OpenVINO's 3x3 convolutions? Winograd F(2x2, 3x3) from library ops.

OpenVINO's f32 convolutions run at about the core's GEMM peak (`headroom.md`), so a plan
that does the same arithmetic cannot be much faster; Winograd's F(2x2, 3x3) does 2.25x
fewer multiplications. This probe writes one 3x3 convolution the way a graph-level rewrite
would hand it to a library: the input transform as a depthwise 4x4 stride-2 convolution
(16 fixed kernels a channel), the products as one batched matmul of 16 [K x C] @ [C x T],
the output transform as a grouped 2x2 stride-2 transposed convolution, and times it against
the direct convolution, interleaved, under OpenVINO at one thread. Writes
experiments/results/winograd.md.

    python experiments/probe_winograd.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

B_T = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float32)
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
A_T = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float32)
SHAPES = [(32, 32, 112), (64, 64, 56), (96, 96, 28), (128, 128, 28), (192, 192, 14), (256, 256, 14)]


def direct(w: np.ndarray, size: int):
    """The 3x3 convolution, pad 1, as the model has it."""
    import openvino as ov
    from openvino import opset13 as ops

    x = ops.parameter([1, w.shape[1], size, size], np.float32)
    return ov.Model([ops.convolution(x, ops.constant(w), [1, 1], [1, 1], [1, 1], [1, 1])], [x])


def winograd(w: np.ndarray, size: int):
    """The same convolution as Winograd F(2x2, 3x3) in OpenVINO ops (``size`` even)."""
    import openvino as ov
    from openvino import opset13 as ops

    k, c = w.shape[:2]
    tiles = (size // 2) ** 2
    x = ops.parameter([1, c, size, size], np.float32)
    into = np.tile(np.einsum("au,bv->abuv", B_T, B_T).reshape(1, 16, 1, 4, 4), (c, 1, 1, 1, 1))
    v = ops.group_convolution(
        x, ops.constant(into), [2, 2], [1, 1], [1, 1], [1, 1]
    )  # [1, 16C, H/2, W/2]
    v = ops.transpose(
        ops.reshape(v, ops.constant(np.array([c, 16, tiles])), False),
        ops.constant(np.array([1, 0, 2])),
    )
    u = np.einsum("ai,kcij,bj->abkc", G, w, G).reshape(16, k, c).astype(np.float32)
    m = ops.matmul(ops.constant(u), v, False, False)  # [16, K, tiles]
    m = ops.transpose(m, ops.constant(np.array([1, 0, 2])))
    m = ops.reshape(m, ops.constant(np.array([1, 16 * k, size // 2, size // 2])), False)
    out = np.tile(np.einsum("pa,qb->abpq", A_T, A_T).reshape(1, 16, 1, 2, 2), (k, 1, 1, 1, 1))
    y = ops.group_convolution_backprop_data(
        m, ops.constant(out), [2, 2], None, [0, 0], [0, 0], [1, 1]
    )
    return ov.Model([y], [x])


def main() -> None:
    import openvino as ov

    from partune.backends.openvino_backend import compile_config, openvino_core
    from partune.runners.timing import time_interleaved

    rng = np.random.default_rng(0)
    lines = [
        "# Winograd F(2x2, 3x3) from OpenVINO ops vs OpenVINO's direct 3x3 convolution",
        "",
        "1 thread, batch 1, pad 1, interleaved rounds (median of each round's fastest repeat). "
        "speed-up > 1: Winograd is faster. (`experiments/probe_winograd.py`)",
        "",
        "| C -> K | H x W | direct ms | direct GFLOP/s | Winograd ms | speed-up | max rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, k, size in SHAPES:
        w = (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32)
        x = rng.standard_normal((1, c, size, size)).astype(np.float32)
        requests = {}
        for label, model in (("direct", direct(w, size)), ("winograd", winograd(w, size))):
            request = (
                openvino_core()
                .compile_model(model, "CPU", compile_config(1))
                .create_infer_request()
            )
            request.set_input_tensor(ov.Tensor(x))
            requests[label] = request
        timed = time_interleaved({label: r.infer for label, r in requests.items()}, rounds=7)
        want, got = (requests[label].get_output_tensor(0).data for label in ("direct", "winograd"))
        error = float(np.abs(want - got).max() / np.abs(want).max())
        d, wg = timed["direct"].median_s, timed["winograd"].median_s
        lines.append(
            f"| {c} -> {k} | {size} x {size} | {d * 1e3:.3f} | "
            f"{2 * 9 * c * k * size * size / d / 1e9:.0f} | {wg * 1e3:.3f} | {d / wg:.2f}x | "
            f"{error:.1e} |"
        )
        print(lines[-1], flush=True)
    out = ROOT / "experiments" / "results" / "winograd.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
