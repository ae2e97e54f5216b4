"""What runs where measurements are taken: a local worker process or an RPC server.

Requests and replies are the typed messages of ``partune.runners.protocol`` (arrays as base64
.npy inside), and ``handle_json`` serves both the local worker (over a pipe) and the RPC
server (over TVM RPC) from the same JSON text. A crash or hang here costs the request,
never the search that sent it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from partune.core import last_line
from partune.runners import accuracy, memory, module_file
from partune.runners.protocol import (
    BuildInfo,
    BuildReply,
    BuildRequest,
    CaptureReply,
    CaptureRequest,
    CompareRequest,
    ErrorReply,
    MeasurementReply,
    MeasurementsReply,
    PlanRequest,
    RegionRequest,
    Reply,
    Request,
    TuneRequest,
    TuningReply,
    decode_array,
    request_from_json,
)
from partune.runners.timing import Measurement, time_callable

if TYPE_CHECKING:
    import tvm

    from partune.core import DataflowGraph, Plan
    from partune.runners.builder import BuiltModel


def _region(req: RegionRequest | TuneRequest | BuildRequest):
    """The region function a region, tune or build request carries, or names in its model's file."""
    import tvm

    if req.module.file is not None:
        return module_file.region(req)[req.function]  # type: ignore[arg-type]
    return tvm.ir.load_json(req.module.text)[req.function]


def tune_region(req: TuneRequest) -> TuningReply:
    """Tune one region for an autotuned backend (where it will be measured); its report."""
    from partune.backends import registry

    registry.set_threads(req.threads)
    report = registry.get(req.backend).tune_region(
        _region(req), req.scope, req.trials, req.timeout_s
    )
    return TuningReply(report)


def build_region(req: RegionRequest | BuildRequest, write: bool = False):
    """The region function of a region (or build) request, its kernel built by its backend,
    and how the build went (``BuildInfo``: its seconds and what the cache did).

    With ``build_cache`` in the request, a backend that can (``caches_builds``) loads what
    a build worker stored (``partune.runners.build_pool``); ``write``: store what is built (build
    workers). The cache entry's key is read from the request's JSON (``build_cache.entry_for``).
    """
    from partune.backends import build_cache, registry

    registry.set_threads(req.threads)
    func = _region(req)
    backend = registry.get(req.backend)
    entry = build_cache.entry_for(req.to_json(), write) if backend.caches_builds else None
    start = time.perf_counter()
    with build_cache.active(entry):
        kernel = backend.build_region(func, req.scope, registry.threads())
    info = BuildInfo(entry.describe() if entry is not None else "off", time.perf_counter() - start)
    return func, kernel, info


def build_into_cache(req: BuildRequest) -> BuildReply:
    """A build worker's request: build a region into the build cache; what happened."""
    from partune.backends import registry

    if not registry.get(req.backend).caches_builds:
        return BuildReply(BuildInfo("not cached by this backend"))
    return BuildReply(build_region(req, write=True)[2])


def measure_region(req: RegionRequest) -> MeasurementReply:
    """Build one region for its backend and time its kernel on the inputs sent (else random
    ones); the reply also says how the build went."""
    import tvm

    from partune.core import random_array, static_shape, tensor_types

    func, kernel, info = build_region(req)
    if req.inputs is not None:  # what the region reads inside the model
        arrays = [decode_array(a) for a in req.inputs]
    else:
        rng = np.random.default_rng(0)
        arrays = [random_array(static_shape(p.ty), str(p.ty.dtype), rng) for p in func.params]
    args = [tvm.runtime.tensor(a) for a in arrays]
    outs = [
        tvm.runtime.tensor(np.empty(static_shape(t), str(t.dtype)))
        for t in tensor_types(func.ret_ty)
    ]
    every = args + outs
    return MeasurementReply(time_callable(lambda: kernel(*every), req.protocol), build=info)


def measure_plan(req: PlanRequest) -> MeasurementReply:
    """Build a whole model under a plan and time it end to end; a plan with bf16 regions
    is also run beside its f32 twin, and its error recorded (``partune.runners.accuracy``)."""
    from partune.backends import registry
    from partune.core import DataflowGraph

    registry.set_threads(req.threads)
    mod = module_file.load(req)
    plan = req.plan
    graph = DataflowGraph.from_function(mod["main"])
    inputs = [decode_array(a) for a in req.inputs]
    if req.fresh:
        _warm_up(plan)
    memory.trim()
    before = memory.resident_bytes()
    built = build_plan_here(plan, mod, graph)
    run = built.prepare(inputs)
    memory.trim()  # the compilers' freed memory is not the plan's
    reset = memory.reset_peak()
    m = time_callable(run, req.protocol)
    peak = memory.peak_bytes()
    footprint = peak - before if reset and peak is not None and before is not None else None
    error = None
    if accuracy.has_reduced(plan):
        error = accuracy.plan_error(
            built, build_plan_here(accuracy.f32_twin(plan), mod, graph), inputs, _judged(req)
        )
    return MeasurementReply(dataclasses.replace(m, peak_bytes=footprint, rel_error=error))


def _judged(req: PlanRequest | CompareRequest) -> tuple[list, str] | None:
    """The validation samples and metric a request's errors are judged by (None: as before)."""
    v = req.validation
    return (v.arrays(), v.metric) if v is not None else None


def build_plan_here(plan: Plan, mod: tvm.IRModule, graph: DataflowGraph) -> BuiltModel:
    """``build_plan``, its kernels then dropped from TVM's global registry.

    The codegens register each region's kernel (an ORT session, an OpenVINO compiled model,
    a torch module with its weights) as a global function under a symbol unique to the
    build; the VM takes its own reference when it is made. Left registered, every plan a
    worker ever built stays alive in it; dropped, a plan's kernels go with its VM.
    """
    import tvm_ffi

    from partune.runners.builder import build_plan

    built = build_plan(plan, mod, graph)
    for func in built.module.functions.values():
        attrs = func.attrs
        if attrs is not None and "Codegen" in attrs and "global_symbol" in attrs:
            tvm_ffi.remove_global_func(str(attrs["global_symbol"]))
    return built


def _warm_up(plan) -> None:
    """Load each backend of ``plan`` and its compiler on a one-op model first, so that the
    footprint measured next is the plan's own, not the libraries' code every plan loads."""
    from partune.core import DataflowGraph, Plan, Region
    from partune.runners.builder import calibration_module

    mod = calibration_module()
    graph = DataflowGraph.from_function(mod["main"])
    for scope in {r.scope for r in plan.regions}:
        one = Plan("warm-up", graph.fingerprint, plan.config, (Region((0,), scope),))
        build_plan_here(one, mod, graph)([np.ones(1, "float32")])


def measure_compare(req: CompareRequest) -> MeasurementsReply:
    """Build plans and peers in this one process, then time them in interleaved rounds.

    The fair comparison against the tools a user would pick instead: same process, same
    inputs, same moment. A contender that cannot be built fails alone.
    """
    from partune.backends import registry
    from partune.core import Plan
    from partune.runners.peers import make_peer, peer_error
    from partune.runners.timing import time_interleaved

    registry.set_threads(req.threads)
    ctx = _context_for(req)
    fns, failed = {}, {}
    # Plans first: once they are built the model is released, before the peers load their own
    # copies.
    for label in sorted(
        req.contenders, key=lambda label: not isinstance(req.contenders[label], Plan)
    ):
        c = req.contenders[label]
        try:
            key = label + json.dumps(
                c.to_json() if isinstance(c, Plan) else c, sort_keys=True, default=str
            )
            if key not in ctx.built:
                if isinstance(c, Plan):
                    ctx.built[key] = build_plan_here(c, ctx.mod, ctx.graph).prepare(ctx.inputs)
                else:
                    ctx.release_model()
                    ctx.built[key] = make_peer(c, ctx.inputs, registry.threads())
            fns[label] = ctx.built[key]
            fns[label]()  # one call outside the clock: lazy initialisation
        except Exception as e:  # noqa: BLE001 - one contender failing must not end the comparison
            fns.pop(label, None)
            failed[label] = Measurement.failed(f"{type(e).__name__}: {last_line(e)}")
        memory.trim()  # what the compiler freed, handed back before the next contender is built
    ctx.release_model()
    timed = time_interleaved(
        {label: fns[label] for label in req.contenders if label in fns}, rounds=req.rounds
    )
    for label, c in req.contenders.items():  # a reduced-precision peer: its error, for the budget
        if label in timed and isinstance(c, dict) and c.get("precision", "f32") != "f32":
            try:
                timed[label] = dataclasses.replace(
                    timed[label],
                    rel_error=peer_error(c, ctx.inputs, registry.threads(), _judged(req)),
                )
            except Exception as e:  # noqa: BLE001 - an error that cannot be measured fails the peer
                timed[label] = Measurement.failed(
                    f"its error against f32 could not be measured: {last_line(e)}"
                )
    return MeasurementsReply(timed | failed)


@dataclasses.dataclass
class _Comparison:
    """The comparison this process takes part in (one at a time): the model, its inputs and
    the contenders built so far. A worker that times one contender of an isolated comparison
    (``partune.runners.isolated``) round after round loads and builds all of it once; one that
    times a peer alone never loads the model's graph. Any other request ends the comparison
    (``handle``): what it built is released."""

    request: CompareRequest
    inputs: list
    built: dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def mod(self) -> Any:
        return module_file.load(self.request)

    @functools.cached_property
    def graph(self) -> Any:
        from partune.core import DataflowGraph

        return DataflowGraph.from_function(self.mod["main"])

    def release_model(self) -> None:
        """Drop the model (its constants: 0.43 GB at 12 BERT-768 layers) once the plans are
        built."""
        if "mod" in self.__dict__:
            del self.__dict__["mod"]
            self.__dict__.pop("graph", None)
            module_file.forget()
            memory.trim()


_CURRENT: dict[str, _Comparison] = {}


def _context_for(req: CompareRequest) -> _Comparison:
    import hashlib

    file = req.module.file
    model = req.module.text if file is None else f"{file}{os.stat(file)}"
    of = hashlib.sha256(f"{model}{req.inputs}{req.threads}".encode()).hexdigest()
    if of not in _CURRENT:
        _CURRENT.clear()
        _CURRENT[of] = _Comparison(req, [decode_array(a) for a in req.inputs])
    return _CURRENT[of]


def _end_comparison() -> None:
    """Release what the last comparison built: its contenders (sessions, VMs, weights), and
    torch.compile's caches of them (dynamo keeps each compiled graph, frozen weights and all,
    until it is reset)."""
    if _CURRENT:
        _CURRENT.clear()
        if "torch" in sys.modules:
            import torch

            torch._dynamo.reset()


def capture_into_file(req: CaptureRequest) -> CaptureReply:
    """The model's values on the request's inputs, written where it says
    (``partune.runners.capture``)."""
    from partune.backends import registry
    from partune.runners.capture import capture_values, save_values

    registry.set_threads(req.threads)
    mod, graph = module_file.with_graph(req)
    values = capture_values(mod, graph, [decode_array(a) for a in req.inputs], list(req.backends))
    save_values(values, mod["main"], req.out_file)
    del values
    memory.trim()  # the whole-model build is gone
    return CaptureReply(req.out_file)


# Every request type and what answers it (a region's reply also says how its build went).
HANDLERS: dict[type, Callable[[Any], Reply]] = {
    RegionRequest: measure_region,
    PlanRequest: measure_plan,
    CompareRequest: measure_compare,
    TuneRequest: tune_region,
    BuildRequest: build_into_cache,
    CaptureRequest: capture_into_file,
}


def _failure(build: bool, e: Exception) -> Reply:
    """A Python error in a handler: a build's ``ErrorReply``, else a failed measurement
    with the traceback (it costs that candidate only)."""
    why = f"{type(e).__name__}: {last_line(e)}"
    if build:
        return ErrorReply(why)
    return MeasurementReply(Measurement.failed(why), trace=traceback.format_exc()[-2000:])


def handle(req: Request) -> Reply:
    """One request -> one reply (``HANDLERS``); Python errors become failed measurements
    (a build request's: an ``ErrorReply``)."""
    if not isinstance(req, CompareRequest):
        _end_comparison()
    try:
        if req.settings is not None:  # what the search process has (``Runner.addressed``)
            from partune.backends import registry

            registry.configure(req.settings)
        return HANDLERS[type(req)](req)
    except Exception as e:  # noqa: BLE001 - any failure costs this candidate only
        return _failure(isinstance(req, BuildRequest), e)


def handle_json(text: str) -> str:
    """The entry point of both transports: a request's JSON in, its reply's JSON out. Text that
    is not a request (a pickle, say) is answered with an error: nothing is ever unpickled."""
    data: object = None
    try:
        data = json.loads(text)
        req = request_from_json(data)
    except Exception as e:  # noqa: BLE001 - a request that cannot be read is answered like a failure
        return json.dumps(
            _failure(isinstance(data, dict) and data.get("kind") == "build", e).to_json()
        )
    return json.dumps(handle(req).to_json())
