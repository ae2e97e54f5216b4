"""Build a partitioned model: BYOC codegens for offloaded regions, TVM for the rest.

Runners know how to build and time, not what is being searched: the builder takes a
validated plan and a model and hands back a runnable Relax VM.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from partune.backends import registry
from partune.core import (
    DataflowGraph,
    ModelFile,
    Plan,
    SEScope,
    flatten_outputs,
    main_bindings,
    partition,
)
from partune.runners.protocol import (
    CaptureRequest,
    CompareRequest,
    ModelRef,
    PlanRequest,
    RegionRequest,
    TuneRequest,
    Validation,
    encode_array,
)
from partune.runners.timing import Protocol

_installed: set[str] = set()
_build_ids = itertools.count()


def install_codegen(backend_name: str) -> None:
    """Register ``relax.ext.<codegen>`` so RunCodegen hands this backend its regions."""
    backend = registry.get(backend_name)
    if backend.codegen is None or backend.codegen in _installed:
        return

    def codegen(funcs, options, constant_names) -> list:
        for func in funcs:
            scope = SEScope.from_json(json.loads(str(func.attrs[partition.SCOPE_ATTR])))
            kernel = backend.build_region(func, scope, registry.threads())
            tvm.register_global_func(str(func.attrs["global_symbol"]), kernel, override=True)
        return []  # kernels live in the global registry, where the VM finds them

    tvm.register_global_func(f"relax.ext.{backend.codegen}", codegen, override=True)
    _installed.add(backend.codegen)


@dataclass
class BuiltModel:
    """A runnable partitioned model."""

    vm: relax.VirtualMachine
    device: tvm.runtime.Device
    module: tvm.IRModule  # the partitioned module, before codegen

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        out = self.vm["main"](*[tvm.runtime.tensor(a, self.device) for a in inputs])
        return flatten_outputs(out)

    def prepare(self, inputs: list[np.ndarray]):
        """A no-argument callable running the model on device-resident inputs (for timing)."""
        args = [tvm.runtime.tensor(a, self.device) for a in inputs]
        main = self.vm["main"]
        return lambda: main(*args)


def main_compiler(plan: Plan):
    """The backend that builds ``main`` (what stays inline): native TVM, or, when the plan
    has tuned TVM regions, the native backend that applies the tuned schedules."""
    inline = [registry.get(b) for b in plan.backends if registry.get(b).codegen is None]
    return next((b for b in inline if b.autotuned), registry.get(registry.NATIVE))


def partition_plan(
    plan: Plan, mod: tvm.IRModule, graph: DataflowGraph, prefix: str
) -> tvm.IRModule:
    """``plan`` applied to ``mod`` with the registry's codegens; tuned TVM regions keep their
    borders (``partune.core.partition``), so they run the workloads that were tuned."""
    return partition.apply(
        plan,
        mod,
        graph,
        lambda b: registry.get(b).codegen,
        prefix=prefix,
        bordered=lambda b: registry.get(b).autotuned,
        int8_placement=lambda b: registry.get(b).int8_placement,
    )


def build_plan(plan: Plan, mod: tvm.IRModule, graph: DataflowGraph) -> BuiltModel:
    """Validate ``plan`` against the model, partition, run the codegens and compile."""
    plan.validate(graph, registry.names())
    # Kernels are registered globally by symbol: a fresh prefix per build keeps a model
    # built earlier in this process from calling a later build's kernels.
    partitioned = partition_plan(plan, mod, graph, prefix=f"b{next(_build_ids)}")
    for name in plan.backends:
        install_codegen(name)
    # Every kernel keeps its own weights (the codegens return no module and ignore
    # ``constant_names``), so the constants RunCodegen collects for them would only be linked
    # into a const loader: a C library compiled and loaded on every build, whose copy of the
    # weights stays mapped for the life of the process.
    lowered = relax.transform.RunCodegen()(partitioned).without_attr("const_name_to_constant")
    host = plan.config.host
    ex = main_compiler(plan).compile(lowered, host.tvm_target())  # type: ignore[attr-defined]
    device = tvm.device(host.device_type or "cpu", host.virtual_device_id or 0)
    return BuiltModel(relax.VirtualMachine(ex, device), device, partitioned)


def build_model_file(plan: Plan, data: bytes, inputs: list[np.ndarray], threads: int):
    """A model-file plan (``Plan.model_file``): the ONNX bytes it runs under its library, in
    its precision (``data``: the model's own file, or the file quantized from it where the plan
    names a quantizer, ``partune.search.model_file_data``, which refuses any other file: the
    one place that check is made).

    Returns a ``partune.backends.model_file.ModelFileRun`` (called and prepared like
    ``BuiltModel``).
    """
    from partune.backends import open_model_file

    file = plan.model_file
    if file is None:
        from partune.core import PlanError

        raise PlanError("not a model-file plan")
    return open_model_file(file.library, data, inputs, threads, file.precision)


def check_source(file: ModelFile, data: bytes) -> None:
    """Raise PlanError unless ``data`` is the ONNX file the model-file plan ``file`` was made
    for (any file, where it was made for an export)."""
    from partune.backends import sha256
    from partune.core import PlanError

    if file.sha256 is not None and sha256(data) != file.sha256:
        raise PlanError(
            f"the plan runs another ONNX file (sha256 {file.sha256[:12]}..., "
            f"this one is {sha256(data)[:12]}...)"
        )


def region_request(
    mod: tvm.IRModule,
    graph: DataflowGraph,
    nodes: tuple[int, ...],
    scope: SEScope,
    protocol: dict | None = None,
    values: dict | None = None,
    build_cache: str | None = None,
    model_file: Path | None = None,
) -> RegionRequest:
    """A request to measure ``nodes`` of main in isolation on ``scope``.

    The region is lifted into a function of its own (``region_module``) and shipped as TVM
    JSON, so the worker needs nothing of the model but this text; with ``model_file`` (``mod``
    as ``partune.runners.module_file`` wrote it) the request names the file and the nodes
    instead, and the worker lifts the region: the search then never writes the region's weights
    as text (a BERT-768 layer: 16 MB of JSON, 0.2 s and 0.1 GB of peak a request). With
    ``values`` (from ``partune.runners.capture``) the request carries the tensors the region
    reads inside the model; without, the worker draws random ones. With ``build_cache`` (a
    directory a ``partune.runners.build_pool.BuildPool`` builds into) the worker loads the
    region built ahead of time when it is there. ``protocol``: ``partune.runners.timing.Protocol``'s
    fields.
    """
    from partune.runners.capture import region_inputs

    nodes = tuple(sorted(nodes))
    func, args = _lift(mod, graph, nodes)
    arrays = region_inputs(args, values) if values is not None else None
    module = (
        ModelRef(file=str(model_file), nodes=nodes)
        if model_file is not None
        else ModelRef(text=tvm.ir.save_json(tvm.IRModule({"region": func})))
    )
    return RegionRequest(
        scope.backend,
        scope,
        module,
        "region",
        Protocol(**(protocol or {})),
        build_cache=build_cache or None,
        inputs=tuple(encode_array(a) for a in arrays) if arrays is not None else None,
    )


def region_module(mod: tvm.IRModule, graph: DataflowGraph, nodes: tuple[int, ...]) -> tvm.IRModule:
    """``nodes`` of main lifted into a module of one function, ``region``: what a region request
    carries, or what a worker makes of a request that names the model's file."""
    return tvm.IRModule({"region": _lift(mod, graph, tuple(sorted(nodes)))[0]})


def _lift(
    mod: tvm.IRModule, graph: DataflowGraph, nodes: tuple[int, ...]
) -> tuple[relax.Function, list]:
    bindings = main_bindings(mod["main"])
    exits = [bindings[n].var for n in partition.region_exits(graph, set(nodes))]
    func, args, _ = partition.lift_region([bindings[n] for n in nodes], exits, "region", {})
    return func, args


def tune_request(
    mod: tvm.IRModule,
    graph: DataflowGraph,
    nodes: tuple[int, ...],
    scope: SEScope,
    trials: int,
    timeout_s: float,
) -> TuneRequest:
    """A request to tune ``nodes`` of main for ``scope``'s (autotuned) backend."""
    req = region_request(mod, graph, nodes, scope)
    return TuneRequest(req.backend, req.scope, req.module, req.function, trials, timeout_s)


def plan_request(
    model: str | Path,
    plan: Plan,
    inputs: list[np.ndarray],
    protocol: dict | None = None,
    fresh: bool = False,
    validation: Validation | None = None,
) -> PlanRequest:
    """A request to build and time the whole model under ``plan``: ``model`` is its
    ``tvm.ir.save_json`` text, or a file holding it (``partune.runners.module_file``).

    ``fresh``: measure in a new worker process, so the peak memory reported is this
    plan's alone (a local runner restarts its worker; slower by the worker's start-up).
    """
    return PlanRequest(
        ModelRef.of(model),
        plan,
        tuple(encode_array(a) for a in inputs),
        Protocol(**(protocol or {})),
        fresh,
        validation,
    )


def compare_request(
    model: str | Path,
    plans: dict[str, Plan],
    peers: dict[str, dict],
    inputs: list[np.ndarray],
    rounds: int = 5,
    validation: Validation | None = None,
) -> CompareRequest:
    """A request to time plans and peers (``partune.runners.peers`` specs) in one process,
    interleaved; ``model`` as for ``plan_request``."""
    contenders: dict[str, Plan | dict] = {**plans, **peers}
    return CompareRequest(
        ModelRef.of(model), contenders, tuple(encode_array(a) for a in inputs), rounds, validation
    )


def capture_request(
    model: str | Path, inputs: list[np.ndarray], backends: list[str], out_file: Path
) -> CaptureRequest:
    """A request to capture the values the model computes inside on ``inputs`` into ``out_file``
    (``partune.runners.capture``); ``model`` as for ``plan_request``."""
    return CaptureRequest(
        ModelRef.of(model), tuple(encode_array(a) for a in inputs), tuple(backends), str(out_file)
    )


def calibration_module() -> tvm.IRModule:
    """The smallest model: one add of one float. Timing it shows fixed per-call costs."""
    x = relax.Var("x", relax.TensorType((1,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(y)
    return bb.get()


def overhead_request(scope: SEScope, protocol: dict | None = None) -> RegionRequest:
    """A request timing the calibration model's only node as an isolated region on ``scope``."""
    return RegionRequest(
        scope.backend,
        scope,
        ModelRef(text=tvm.ir.save_json(calibration_module())),
        "main",
        Protocol(**(protocol or {})),
    )
