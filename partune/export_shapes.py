"""Write the deploy directory of a plan with shape buckets (``partune.core.shapes``).

Each bucket is exported as a deploy directory of its own (``bucket<i>/``, the model imported
at the bucket's point; its library regions registered under symbols of their own, so the
buckets live side by side in one process). Beside them goes the user's own file
(``model.onnx``), run by the fallback library for the shapes no bucket serves, and a manifest
holding the buckets, the axes and how calls are routed, with the file's checksum.
``partune.deployed.load`` reads it and dispatches each call by its shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from partune.backends import checksums, registry
from partune.core import ShapePlans, deploy_environment, device_fingerprint
from partune.deployed import FORMAT, MANIFEST
from partune.export import staged, write_plan

MODEL_FILE = "model.onnx"  # the user's file: the fallback


def export_buckets(
    plans: ShapePlans, load_at: Callable[[int], object], out: str | Path, threads: int = 1
) -> Path:
    """Every bucket of ``plans`` compiled into ``out`` (replaced if it exists), with the user's
    file for the fallback; ``load_at(i)`` imports the model at bucket ``i``'s input shapes
    (one at a time: a model's import is let go before the next)."""
    return staged(out, lambda staging: _write(plans, load_at, staging, threads))


def _write(plans: ShapePlans, load_at: Callable[[int], object], out: Path, threads: int) -> None:
    model = None
    for i, bucket in enumerate(plans.buckets):
        model = load_at(i)
        bucket.plan.validate(model.graph, registry.names())
        folder = out / f"bucket{i}"
        folder.mkdir()
        write_plan(model, bucket.plan, folder, threads, prefix=f"deploy_b{i}")
    (out / MODEL_FILE).write_bytes(model.onnx_bytes)
    fallback = plans.fallback
    manifest = {
        "format": FORMAT,
        "model": model.name,
        "threads": threads,
        "device_fingerprint": device_fingerprint(threads),
        "environment": deploy_environment([fallback]),
        "backends": [fallback],
        "inputs": [
            {"name": p.name, "dtype": str(a.dtype)}
            for p, a in zip(model.mod["main"].params, model.inputs, strict=True)
        ],
        "shapes": plans.to_json(),
        "buckets": [f"bucket{i}" for i in range(len(plans.buckets))],
        "fallback": {"library": fallback, "file": MODEL_FILE},
        "files": checksums(out, [MODEL_FILE]),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
