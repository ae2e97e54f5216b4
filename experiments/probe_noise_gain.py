"""How unequally does a layer's noise reach a deep network's output? The case for building int8
up from f32 (``partune.search.precision.build_up_units``).

For each model, 1% Gaussian noise (of the tensor's own spread) is added to the output of one
convolution or linear layer at a time, at five depths, and the model's output is compared with
the clean one (norm-wise relative error, seeded). Where a layer's noise reaches the output
amplified, its int8 costs most of a 1% budget; where it arrives damped, int8 is nearly free.
Runs on the benchmark's torch modules (CPU, f32); writes experiments/results/noise_gain.md.

    python experiments/probe_noise_gain.py [MODEL ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ["resnet50", "densenet", "mobilenet_v3_small", "squeezenet1_1"]
NOISE = 0.01


def _first(y):
    return y[0] if isinstance(y, (tuple, list)) else y


def noise_gains(name: str) -> list[tuple[int, int, float]]:
    """(layer index, layers, output error) for 1% noise at five depths of ``name``."""
    from experiments.architectures import get

    torch.manual_seed(0)
    module, inputs = get(name).build()
    module.eval()
    layers = [m for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    n = len(layers)
    rows = []
    with torch.no_grad():
        ref = _first(module(*inputs))
        for k in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}):
            hook = layers[k].register_forward_hook(
                lambda m, i, o: o + NOISE * o.std() * torch.randn_like(o)
            )
            y = _first(module(*inputs))
            hook.remove()
            rows.append((k, n, float((y - ref).norm() / ref.norm())))
    return rows


def main(argv: list[str] | None = None) -> int:
    models = (argv if argv is not None else sys.argv[1:]) or MODELS
    lines = [
        "# A layer's 1% noise at the model's output",
        "",
        "Relative error of the output when 1% Gaussian noise (of the tensor's spread) is added",
        "to one layer's output (random, BatchNorm-calibrated weights; `probe_noise_gain.py`).",
        "",
        "| model | layer (of n) | output error |",
        "|---|---|---|",
    ]
    for name in models:
        for k, n, err in noise_gains(name):
            lines.append(f"| {name} | {k} of {n} | {err:.2%} |")
            print(lines[-1], flush=True)
    out = ROOT / "experiments" / "results" / "noise_gain.md"
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
