"""Write a deploy directory for a model under a plan (the loader is ``partune.deployed``).

The plan is applied, the library regions are saved one file each (the Relax function,
as TVM JSON, from which the loading process rebuilds the kernel), the whole module is
compiled and exported with ``export_library``, and a manifest records checksums, the
environment and the model's inputs, so a changed file or a different environment is
refused at load time instead of running something else. Beside it goes the partition as
an annotated ONNX file (``partition.onnx``) to look at in Netron.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from partune.backends import checksums, registry
from partune.core import Plan, deploy_environment, device_fingerprint, partition
from partune.deployed import FORMAT, MANIFEST
from partune.partition_onnx import write_partition_onnx
from partune.runners import install_codegen, main_compiler, partition_plan
from partune.store import pid_alive

LIBRARY = "model.so"
MODEL_FILE = "model.onnx"  # a model-file plan's graph


def export(model, plan: Plan, out: str | Path, threads: int = 1, samples=None) -> Path:
    """Compile ``model`` under ``plan`` into ``out`` (replaced if it exists); returns ``out``.
    ``samples``: the ``TuneOptions`` holding the calibration and validation samples a quantized
    model-file plan's file was made on (None: the synthetic ones, ``model_file_data``)."""
    plan.validate(model.graph, registry.names())
    return staged(out, lambda staging: write_plan(model, plan, staging, threads, samples=samples))


def write_plan(
    model, plan: Plan, out: Path, threads: int, prefix: str = "deploy", samples=None
) -> Path:
    """``model`` under ``plan`` written into the empty folder ``out``; its library regions are
    registered in the loading process under symbols that start with ``prefix``."""
    if plan.model_file is not None:
        return _export_model_file(model, plan, out, threads, samples)
    return _export_regions(model, plan, out, threads, prefix)


def staged(out: str | Path, write: Callable[[Path], object]) -> Path:
    """``write`` a deploy directory into a staging folder beside ``out``, then move it into
    place whole: an export killed half way leaves the previous deployment as it was, never a
    half-written one, and the next export clears what the killed one left."""
    out = Path(out)
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a deploy directory: not overwriting it")
    _clear_leftovers(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    staging.mkdir(parents=True)
    try:
        write(staging)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _leftover_owner(path: Path, out: Path) -> int | None:
    """The process id in a staging (``.partial-PID``) or retired (``.old-PID``) folder's name."""
    for kind in ("partial", "old"):
        prefix = f".{out.name}.{kind}-"
        if path.name.startswith(prefix) and path.name[len(prefix) :].isdigit():
            return int(path.name[len(prefix) :])
    return None


def _clear_leftovers(out: Path) -> None:
    """Remove the staging folders of exports to ``out`` whose process is gone (killed)."""
    if not out.parent.is_dir():
        return
    for path in out.parent.glob(f".{out.name}.*-*"):
        pid = _leftover_owner(path, out)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _move_into_place(staging: Path, out: Path) -> None:
    """``staging`` becomes ``out``; an existing ``out`` is retired first, then removed."""
    retired = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)


def _export_regions(model, plan: Plan, out: Path, threads: int, prefix: str) -> Path:
    """A partitioned plan: its library regions one file each, the rest compiled into
    ``model.so``."""
    (out / "regions").mkdir(parents=True)
    partitioned = partition_plan(plan, model.mod, model.graph, prefix=prefix)
    regions = []
    for func in partitioned.functions.values():
        if (
            not isinstance(func, relax.Function)
            or func.attrs is None
            or "Codegen" not in func.attrs
        ):
            continue
        symbol = str(func.attrs["global_symbol"])
        scope = json.loads(str(func.attrs[partition.SCOPE_ATTR]))
        name = f"regions/{symbol}.json"
        (out / name).write_text(tvm.ir.save_json(tvm.IRModule({"region": func})))
        regions.append(
            {
                "symbol": symbol,
                "backend": scope["backend"],
                "file": name,
                "device_type": scope.get("device_type") or "cpu",
                "virtual_device_id": scope.get("virtual_device_id") or 0,
            }
            | {k: scope[k] for k in ("precision", "threads") if k in scope}
        )  # bf16, fewer threads only
    for backend in plan.backends:
        install_codegen(backend)
    lowered = relax.transform.RunCodegen()(partitioned).without_attr(
        "const_name_to_constant"
    )  # see build_plan
    host = plan.config.host
    ex = main_compiler(plan).compile(lowered, host.tvm_target())  # type: ignore[attr-defined]
    ex.export_library(str(out / LIBRARY))
    return _finish(
        model,
        plan,
        out,
        threads,
        {
            "library": LIBRARY,
            "regions": regions,
            "backends": sorted({r["backend"] for r in regions}),
        },
    )


def _export_model_file(model, plan: Plan, out: Path, threads: int, samples) -> Path:
    """A model-file plan: the model's own ONNX graph (or the plan's quantization of it), loaded
    by its library, in the plan's precision, where deployed."""
    from partune.runners import build_model_file
    from partune.search import model_file_data

    data = model_file_data(model, plan.model_file, samples)
    build_model_file(plan, data, model.inputs, threads)  # the file is the plan's, and it loads
    (out / MODEL_FILE).write_bytes(data)
    library = plan.model_file.library
    return _finish(
        model,
        plan,
        out,
        threads,
        {
            "model_file": plan.model_file.to_json() | {"file": MODEL_FILE},
            "regions": [],
            "backends": [library],
        },
    )


def _finish(model, plan: Plan, out: Path, threads: int, contents: dict) -> Path:
    """Write the plan, example inputs, reference outputs and the manifest (with checksums)."""
    plan.save(out / "plan.json")
    np.savez(out / "example_inputs.npz", *model.inputs)
    np.savez(out / "reference_outputs.npz", *model.reference)
    params = model.mod["main"].params
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    host = plan.config.host
    manifest = {
        "format": FORMAT,
        "model": model.name,
        "model_fingerprint": model.graph.fingerprint,
        "reference": model.reference_source,
        "device_type": host.device_type or "cpu",
        "target": host.to_json(),
        "threads": threads,
        "device_fingerprint": device_fingerprint(threads),
        "environment": deploy_environment(contents["backends"]),
        "plan_backends": list(plan.backends),
        "inputs": [
            {"name": p.name, "shape": list(a.shape), "dtype": str(a.dtype)}
            for p, a in zip(params, model.inputs, strict=True)
        ],
        **contents,
        "files": checksums(out, files),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    # The partition for Netron (``partition_onnx``): written after the manifest, so it is not
    # part of what loads and is checked; a model the exporter cannot translate simply has none.
    write_partition_onnx(plan, model, out)
    return out
