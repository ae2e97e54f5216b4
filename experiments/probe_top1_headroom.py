"""How much int8 can a classifier take before one validation sample in a hundred flips its top-1
class? An upper bound on what any search (Partune's or NNCF's) can win under the top-1 budget
of ``bench_precision.py --metric top1``.

Each convolution and linear layer is simulated in int8 in torch (weights symmetric per output
channel, inputs asymmetric per tensor over the min/max of the 16 calibration samples, as
onnxruntime's QDQ does), on the benchmark's own classifiers and samples (calibration seeds 100..,
validation seeds 1000.., drawn like the model's inputs). Layers go int8 greedily, most FLOPs per
unit of their error alone first, and each one is kept only if the *validation* set still meets
the budget: an oracle that checks every step against the very samples the budget is judged on,
which no honest search may do. So the FLOP share it reaches is more than a search can keep,
and the speed-up it allows (FLOPs moved at the measured whole-int8 speed) is a ceiling.

    python experiments/probe_top1_headroom.py [--again] [MODEL ...]   # results/top1_headroom.md
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
sys.path.insert(0, str(ROOT))

# The benchmark's classifiers but the held-out one (no decision looks at it).
MODELS = ["squeezenet1_1", "mobilenet_v3_small", "densenet", "convnext-small", "vit-small"]
CALIBRATION = range(100, 116)
VALIDATION = range(1000, 1100)
TOP1_BUDGET = 1  # flips of 100
REL_BUDGET = 1e-2


@dataclass
class Unit:
    layer: torch.nn.Module
    flops: float = 0.0
    lo: float = float("inf")
    hi: float = float("-inf")


def build(name: str) -> tuple[torch.nn.Module, list[np.ndarray]]:
    """The benchmark's torch module for ``name`` (zoo or architecture) and its example inputs."""
    from partune.frontend.zoo import ZOO

    if name in ZOO:
        entry = ZOO[name]
        module, inputs = entry.build(), entry.inputs()
    else:
        from experiments.architectures import get

        module, inputs = get(name).build()
    return module.eval(), [x.numpy() for x in inputs]


def batch(sets: list[list[np.ndarray]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.concatenate(xs)) for xs in zip(*sets, strict=True))


def logits(module: torch.nn.Module, x: tuple[torch.Tensor, ...]) -> torch.Tensor:
    y = module(*x)
    y = y[0] if isinstance(y, (tuple, list)) else y
    return y.reshape(-1, y.shape[-1]).double()


def fake_int8_weight(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().flatten(1).amax(1).clamp_min(1e-12) / 127
    shape = (-1,) + (1,) * (w.dim() - 1)
    return (w / scale.view(shape)).round().clamp(-127, 127) * scale.view(shape)


def fake_uint8(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-12) / 255
    zero = round(-lo / scale)
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


def calibrate(module: torch.nn.Module, x: tuple[torch.Tensor, ...]) -> list[Unit]:
    """The int8 units with their FLOPs (per sample) and input ranges over ``x``."""
    units = [Unit(m) for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]

    def record(unit: Unit):
        def hook(m, inp, out):
            a = inp[0]
            unit.lo, unit.hi = min(unit.lo, float(a.min())), max(unit.hi, float(a.max()))
            per_out = m.weight[0].numel()
            unit.flops = 2.0 * per_out * out[0].numel()

        return hook

    hooks = [u.layer.register_forward_hook(record(u)) for u in units]
    with torch.no_grad():
        module(*x)
    for h in hooks:
        h.remove()
    return units


def run_with(module, x, units: list[Unit]) -> torch.Tensor:
    """``module`` on ``x`` with ``units`` in simulated int8."""
    saved, hooks = [], []
    for u in units:
        saved.append(u.layer.weight.data)
        u.layer.weight.data = fake_int8_weight(u.layer.weight.data)
        hooks.append(
            u.layer.register_forward_pre_hook(
                lambda m, inp, u=u: (fake_uint8(inp[0], u.lo, u.hi), *inp[1:])
            )
        )
    try:
        with torch.no_grad():
            return logits(module, x)
    finally:
        for u, w in zip(units, saved, strict=True):
            u.layer.weight.data = w
        for h in hooks:
            h.remove()


def flips(y: torch.Tensor, ref: torch.Tensor) -> int:
    return int((y.argmax(-1) != ref.argmax(-1)).sum())


def rel(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-sample norm-wise relative error."""
    return (y - ref).norm(dim=-1) / ref.norm(dim=-1)


def margins(ref: torch.Tensor) -> torch.Tensor:
    """Per sample, the gap between the top two logits over the logits' spread."""
    top = ref.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) / ref.std(dim=-1)


def headroom(name: str) -> dict:
    module, inputs = build(name)
    from partune.core import draw_like

    calib = batch([draw_like(inputs, s) for s in CALIBRATION])
    valid = batch([draw_like(inputs, s) for s in VALIDATION])
    units = calibrate(module, calib)
    with torch.no_grad():
        ref = logits(module, valid)
    whole = run_with(module, valid, units)
    alone = {
        i: float((rel(run_with(module, valid, [u]), ref) ** 2).mean()) for i, u in enumerate(units)
    }
    order = sorted(alone, key=lambda i: -units[i].flops / max(alone[i], 1e-30))
    total = sum(u.flops for u in units)
    shares = {}
    for budget in ("top1", "rel"):
        kept: list[Unit] = []
        for i in order:
            y = run_with(module, valid, [*kept, units[i]])
            ok = (
                flips(y, ref) <= TOP1_BUDGET
                if budget == "top1"
                else rel(y, ref).max() <= REL_BUDGET
            )
            if ok:
                kept.append(units[i])
        shares[budget] = (len(kept), sum(u.flops for u in kept) / total)
    m = margins(ref)
    return {
        "model": name,
        "units": len(units),
        "whole_flips": flips(whole, ref),
        "whole_rel": float(rel(whole, ref).max()),
        "margin_p01": float(m.kthvalue(2).values),
        "margin_median": float(m.median()),
        "top1": shares["top1"],
        "rel": shares["rel"],
    }


def peer_ms(name: str) -> tuple[float, float, float] | None:
    """(fastest f32 peer, OpenVINO's whole-int8 file, fastest peer within the top-1 budget)
    in ms, from the top-1 table's interleaved verdict (None where the model has no row)."""
    path = RESULTS / "precision_top1.json"
    rows = {r["model"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    if name not in rows:
        return None
    verdict, errors = rows[name]["verdict"], rows[name]["rel_errors"]
    peers = {
        k: s * 1e3
        for k, s in verdict.items()
        if "your .onnx file" in k or "torch.onnx.export" in k or k.startswith("torch.compile")
    }
    f32 = min(s for k, s in peers.items() if "int8" not in k and "bf16" not in k)
    int8 = next(s for k, s in peers.items() if k.startswith("openvino int8 ("))
    within = min(s for k, s in peers.items() if errors.get(k, 0.0) <= TOP1_BUDGET / 100)
    return f32, int8, within


def ceilings(share: float, times: tuple[float, float, float] | None) -> tuple[float, float]:
    """The oracle plan's speed-up over the fastest f32 peer and over the fastest peer within
    budget: ``share`` of the f32 peer's time run at the whole-int8 file's speed, no borders
    (or all of it in f32, where int8 runs slower)."""
    if times is None:
        return float("nan"), float("nan")
    f32, int8, within = times
    plan = min(f32, f32 * (1 - share) + int8 * share)
    return f32 / plan, within / plan


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    models = (argv if argv is not None else sys.argv[1:]) or MODELS
    cache = RESULTS / "top1_headroom.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}
    lines = [
        "# How much int8 fits a top-1 budget of one flip in 100",
        "",
        "Each convolution and linear layer simulated in int8 in torch (weights per channel,",
        "inputs per tensor over 16 calibration samples), on the top-1 benchmark's samples. Layers",
        "go int8 most FLOPs per unit of error first, each kept only if the 100 validation samples",
        "still meet the budget (an oracle: it checks every step on the samples the budget is",
        "judged on). The ceilings run that FLOP share of the fastest f32 peer's time at the",
        "whole-int8 OpenVINO file's speed, with no border cost (or none of it, where int8 runs",
        "slower), against the peers of",
        "`precision_top1.json` (its interleaved verdict). margin: the gap between the top two",
        "logits over the logits' spread, the 2nd-smallest of 100 samples and the median",
        "(`probe_top1_headroom.py`; `--again` recomputes the cached `top1_headroom.json`).",
        "",
        "| model | units | whole int8: flips of 100, worst rel | margin 2nd-smallest / median "
        "| int8 within rel 1e-2 (units, FLOPs) | int8 within top-1 (units, FLOPs) "
        "| ceiling x fastest f32 peer | ceiling x fastest peer within budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    again, within = "--again" in models, []
    for name in [m for m in models if m != "--again"]:
        if again or name not in done:
            done[name] = headroom(name)
            cache.write_text(json.dumps(done, indent=1))
        r = done[name]
        over_f32, over_within = ceilings(r["top1"][1], peer_ms(name))
        (kt, st), (kr, sr) = r["top1"], r["rel"]
        lines.append(
            f"| {name} | {r['units']} | {r['whole_flips']}, {r['whole_rel']:.1e} "
            f"| {r['margin_p01']:.4f} / {r['margin_median']:.3f} "
            f"| {kr}, {sr:.0%} | {kt}, {st:.0%} | {over_f32:.2f}x | {over_within:.2f}x |"
        )
        print(lines[-1], flush=True)
        within.append(over_within)
    mean = float(np.exp(np.mean(np.log(within))))
    lines += ["", f"Geomean ceiling over the fastest peer within budget: **{mean:.2f}x**."]
    (RESULTS / "top1_headroom.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
