"""What runs where measurements are taken: a local worker process or an RPC server.

Requests and replies are plain JSON-able dicts (arrays as base64 .npy), so the same
function serves the local worker (over a pipe) and the RPC server (over TVM RPC).
A crash or hang here costs the request, never the search that sent it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback

import numpy as np

from partune.core.errors import last_line
from partune.runners import memory
from partune.runners.protocol import decode_array, random_array
from partune.runners.timing import Measurement, Protocol, time_callable


def _protocol(req: dict) -> Protocol:
    return Protocol(**req.get("protocol", {}))


def _region(req: dict):
    """The region function and SEScope a region or tune request carries."""
    import tvm

    from partune.core.scopes import SEScope

    return tvm.ir.load_json(req["module"])[req["function"]], SEScope.from_json(req["scope"])


def tune_region(req: dict) -> dict:
    """Tune one region for an autotuned backend (where it will be measured); its report."""
    from partune.backends import registry

    registry.set_threads(req.get("threads", 1))
    func, scope = _region(req)
    return registry.get(req["backend"]).tune_region(func, scope, req["trials"], req["timeout_s"])


def build_region(req: dict, write: bool = False, info: dict | None = None):
    """The region function of a region request and its kernel, built by its backend.

    With ``build_cache`` in the request, a backend that can (``caches_builds``) loads what
    a build worker stored (``partune.runners.build_pool``); ``write``: store what is built (build
    workers). ``info`` receives the build's seconds and what the cache did.
    """
    from partune.backends import build_cache, registry

    registry.set_threads(req.get("threads", 1))
    func, scope = _region(req)
    backend = registry.get(req["backend"])
    entry = build_cache.entry_for(req, write) if backend.caches_builds else None
    start = time.perf_counter()
    with build_cache.active(entry):
        kernel = backend.build_region(func, scope, registry.threads())
    if info is not None:
        info |= {"build_s": time.perf_counter() - start,
                 "cache": entry.describe() if entry is not None else "off"}
    return func, kernel


def build_into_cache(req: dict) -> dict:
    """A build worker's request: build a region into the build cache; what happened."""
    from partune.backends import registry

    if not registry.get(req["backend"]).caches_builds:
        return {"cache": "not cached by this backend"}
    info: dict = {}
    build_region(req, write=True, info=info)
    return info


def measure_region(req: dict, info: dict | None = None) -> Measurement:
    """Build one region for its backend and time its kernel on the inputs sent (else random ones).

    ``info`` receives how the build went (``build_region``).
    """
    import tvm

    from partune.core.tensors import static_shape, tensor_types

    func, kernel = build_region(req, info=info)
    if "inputs" in req:  # what the region reads inside the model
        arrays = [decode_array(a) for a in req["inputs"]]
    else:
        rng = np.random.default_rng(0)
        arrays = [random_array(static_shape(p.ty), str(p.ty.dtype), rng) for p in func.params]
    args = [tvm.runtime.tensor(a) for a in arrays]
    outs = [tvm.runtime.tensor(np.empty(static_shape(t), str(t.dtype))) for t in tensor_types(func.ret_ty)]
    every = args + outs
    return time_callable(lambda: kernel(*every), _protocol(req))


def measure_plan(req: dict) -> Measurement:
    """Build a whole model under a plan and time it end to end."""
    import tvm

    from partune.backends import registry
    from partune.core.graph import DataflowGraph
    from partune.core.plan import Plan
    from partune.runners.builder import build_plan

    registry.set_threads(req.get("threads", 1))
    mod = tvm.ir.load_json(req["module"])
    plan = Plan.from_json(req["plan"])
    graph = DataflowGraph.from_function(mod["main"])
    inputs = [decode_array(a) for a in req["inputs"]]
    if req.get("fresh"):
        _warm_up(plan)
    memory.trim()
    before = memory.resident_bytes()
    run = build_plan(plan, mod, graph).prepare(inputs)
    memory.trim()  # the compilers' freed memory is not the plan's
    reset = memory.reset_peak()
    m = time_callable(run, _protocol(req))
    peak = memory.peak_bytes()
    footprint = peak - before if reset and peak is not None and before is not None else None
    return dataclasses.replace(m, peak_bytes=footprint)


def _warm_up(plan) -> None:
    """Load each backend of ``plan`` and its compiler on a one-op model first, so that the
    footprint measured next is the plan's own, not the libraries' code every plan loads."""
    from partune.core.graph import DataflowGraph
    from partune.core.plan import Plan, Region
    from partune.runners.builder import build_plan, calibration_module

    mod = calibration_module()
    graph = DataflowGraph.from_function(mod["main"])
    for scope in {r.scope for r in plan.regions}:
        one = Plan("warm-up", graph.fingerprint, plan.config, (Region((0,), scope),))
        build_plan(one, mod, graph)([np.ones(1, "float32")])


def measure_compare(req: dict) -> dict[str, Measurement]:
    """Build plans and peers in this one process, then time them in interleaved rounds.

    The fair comparison against the tools a user would pick instead: same process, same
    inputs, same moment. A contender that cannot be built fails alone.
    """
    import tvm

    from partune.backends import registry
    from partune.core.graph import DataflowGraph
    from partune.core.plan import Plan
    from partune.runners.builder import build_plan
    from partune.runners.peers import make_peer
    from partune.runners.timing import time_interleaved

    registry.set_threads(req.get("threads", 1))
    mod = tvm.ir.load_json(req["module"])
    graph = DataflowGraph.from_function(mod["main"])
    inputs = [decode_array(a) for a in req["inputs"]]
    fns, failed = {}, {}
    for label, c in req["contenders"].items():
        try:
            if c["kind"] == "plan":
                fns[label] = build_plan(Plan.from_json(c["plan"]), mod, graph).prepare(inputs)
            else:
                fns[label] = make_peer(c, inputs, registry.threads())
            fns[label]()  # one call outside the clock: lazy initialisation
        except Exception as e:  # noqa: BLE001 - one contender failing must not end the comparison
            fns.pop(label, None)
            failed[label] = Measurement.failed(f"{type(e).__name__}: {last_line(e)}")
    return time_interleaved(fns, rounds=req.get("rounds", 5)) | failed


# Request kinds besides "region" (``handle`` calls ``measure_region`` itself: it also reports the build).
HANDLERS = {"plan": measure_plan, "compare": measure_compare, "tune": tune_region, "build": build_into_cache}


def handle(req: dict) -> dict:
    """One request -> one reply; Python errors become failed measurements.

    A region's reply also says how its build went (``"build"``: seconds, cache outcome);
    a build request's reply is ``{"build": ...}`` or ``{"error": why}``.
    """
    info: dict = {}
    try:
        m = measure_region(req, info) if req["kind"] == "region" else HANDLERS[req["kind"]](req)
    except Exception as e:  # noqa: BLE001 - any failure costs this candidate only
        if req["kind"] == "build":
            return {"error": f"{type(e).__name__}: {last_line(e)}"}
        m = Measurement.failed(f"{type(e).__name__}: {last_line(e)}")
        return {"measurement": m.to_json(), "trace": traceback.format_exc()[-2000:]}
    if req["kind"] == "tune":
        return {"tuning": m}
    if req["kind"] == "build":
        return {"build": m}
    if isinstance(m, dict):
        return {"measurements": {label: x.to_json() for label, x in m.items()}}
    return {"measurement": m.to_json()} | ({"build": info} if info else {})


def handle_json(text: str) -> str:
    """The RPC entry point: JSON in, JSON out."""
    return json.dumps(handle(json.loads(text)))
