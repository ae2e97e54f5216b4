"""Write a deploy directory for a model under a plan (the loader is ``partune.deployed``).

The plan is applied, the library regions are saved one file each (the Relax function,
as TVM JSON, from which the loading process rebuilds the kernel), the whole module is
compiled and exported with ``export_library``, and a manifest records checksums, the
environment and the model's inputs, so a changed file or a different environment is
refused at load time instead of running something else.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from partune.backends import registry
from partune.backends.checksum import checksums
from partune.core import partition
from partune.core.plan import Plan
from partune.core.versions import deploy_environment, device_fingerprint
from partune.deployed import FORMAT, MANIFEST
from partune.runners.builder import install_codegen, main_compiler, partition_plan

LIBRARY = "model.so"
MODEL_FILE = "model.onnx"  # a model-file plan's graph


def export(model, plan: Plan, out: str | Path, threads: int = 1) -> Path:
    """Compile ``model`` under ``plan`` into ``out`` (replaced if it exists); returns ``out``."""
    out = Path(out)
    plan.validate(model.graph, registry.names())
    if out.exists():
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not a deploy directory: not overwriting it")
        shutil.rmtree(out)
    if plan.model_file is not None:
        return _export_model_file(model, plan, out, threads)
    (out / "regions").mkdir(parents=True)
    partitioned = partition_plan(plan, model.mod, model.graph, prefix="deploy")
    regions = []
    for func in partitioned.functions.values():
        if not isinstance(func, relax.Function) or func.attrs is None or "Codegen" not in func.attrs:
            continue
        symbol = str(func.attrs["global_symbol"])
        scope = json.loads(str(func.attrs[partition.SCOPE_ATTR]))
        name = f"regions/{symbol}.json"
        (out / name).write_text(tvm.ir.save_json(tvm.IRModule({"region": func})))
        regions.append({"symbol": symbol, "backend": scope["backend"], "file": name,
                        "device_type": scope.get("device_type") or "cpu",
                        "virtual_device_id": scope.get("virtual_device_id") or 0})
    for backend in plan.backends:
        install_codegen(backend)
    lowered = relax.transform.RunCodegen()(partitioned)
    host = plan.config.host
    ex = main_compiler(plan).compile(lowered, host.tvm_target())  # type: ignore[attr-defined]
    ex.export_library(str(out / LIBRARY))
    return _finish(model, plan, out, threads, {"library": LIBRARY, "regions": regions,
                                                "backends": sorted({r["backend"] for r in regions})})


def _export_model_file(model, plan: Plan, out: Path, threads: int) -> Path:
    """A model-file plan: the model's own ONNX graph, loaded by its library where deployed."""
    from partune.runners.builder import build_model_file
    from partune.runners.peers import model_onnx

    data = model_onnx(model)
    build_model_file(plan, data, model.inputs, threads)  # the file is the plan's, and it loads
    out.mkdir(parents=True)
    (out / MODEL_FILE).write_bytes(data)
    library = plan.model_file.library
    return _finish(model, plan, out, threads, {"model_file": plan.model_file.to_json() | {"file": MODEL_FILE},
                                               "regions": [], "backends": [library]})


def _finish(model, plan: Plan, out: Path, threads: int, contents: dict) -> Path:
    """Write the plan, example inputs, reference outputs and the manifest (with checksums)."""
    plan.save(out / "plan.json")
    np.savez(out / "example_inputs.npz", *model.inputs)
    np.savez(out / "reference_outputs.npz", *model.reference)
    params = model.mod["main"].params
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    host = plan.config.host
    manifest = {
        "format": FORMAT, "model": model.name, "model_fingerprint": model.graph.fingerprint,
        "reference": model.reference_source, "device_type": host.device_type or "cpu",
        "target": host.to_json(), "threads": threads, "device_fingerprint": device_fingerprint(threads),
        "environment": deploy_environment(contents["backends"]), "plan_backends": list(plan.backends),
        "inputs": [{"name": p.name, "shape": list(a.shape), "dtype": str(a.dtype)}
                   for p, a in zip(params, model.inputs, strict=True)],
        **contents, "files": checksums(out, files),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out
