"""The typed protocol between the search and the measuring processes.

Every request and reply round-trips exactly through ``to_json``/``from_json`` (the RPC path's
JSON text), every request kind is answered through ``handle_json`` (the RPC entry), the Runner
reads replies by their type, and a region's build-cache key is the one the dict requests had.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import tvm

from partune.backends import build_cache, registry
from partune.backends.settings import Settings
from partune.backends.tvm_backend import TvmBackend
from partune.core import partition
from partune.core.graph import DataflowGraph, main_bindings
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig
from partune.runners import module_file
from partune.runners.builder import (
    capture_request,
    compare_request,
    overhead_request,
    plan_request,
    region_request,
    tune_request,
)
from partune.runners.protocol import (
    REPLY_TYPES,
    REQUEST_TYPES,
    BuildInfo,
    BuildReply,
    BuildRequest,
    CaptureReply,
    ErrorReply,
    MeasurementReply,
    MeasurementsReply,
    ModelRef,
    ProtocolError,
    RegionRequest,
    TuningReply,
    failure_of,
    reply_from_json,
    request_from_json,
)
from partune.runners.runner import Runner
from partune.runners.timing import Measurement, Protocol
from partune.runners.worker import handle, handle_json
from tests.graphs import Chain, Diamond

FAST = {"warmup": 1, "warmup_ms": 1.0, "repeat": 2, "min_repeat_ms": 1.0}
GRAPH = DataflowGraph.from_function(Diamond["main"])
CONFIG = CompilationConfig.for_cpu(["tvm", "onnxruntime"], 1)
INPUTS = [np.random.default_rng(0).standard_normal((4, 4)).astype("float32")]
REPORT = {"trials_run": 0, "timed_out": False, "tasks": []}


class TuneReportBackend(TvmBackend):
    """TVM whose tuning reports at once (a TuningReply without MetaSchedule)."""

    name = "tunereport"

    def tune_region(self, func, scope, trials, timeout_s):
        return REPORT | {"trials": trials}


@pytest.fixture
def tunereport():
    registry.register("tunereport", "tests.test_protocol:TuneReportBackend")
    yield CompilationConfig.for_cpu(["tunereport"], 1).scope_for("tunereport")
    registry.unregister("tunereport")


def requests(cache: str = "/tmp/cache") -> list:
    """One of each request kind, as the builder makes them (optional fields set and not)."""
    tvm_scope, ort_scope = CONFIG.scope_for("tvm"), CONFIG.scope_for("onnxruntime")
    values = {b.var: INPUTS[0] for b in Diamond["main"].body.blocks[0].bindings} | {
        Diamond["main"].params[0]: INPUTS[0]
    }
    plan = single_backend_plan("diamond", GRAPH, CONFIG, "onnxruntime", {0, 1})
    region = region_request(Diamond, GRAPH, (0, 1), tvm_scope, FAST)
    peers = {"onnxruntime (export)": {"kind": "unavailable", "why": "no export"}}
    settings = Settings(tvm_database="/db", tuning_database="/t", extra_backends=(("x", "m:C"),))
    return [
        region,
        replace(region, threads=2, settings=settings),
        region_request(Diamond, GRAPH, (1, 2, 3), ort_scope, FAST, values, build_cache=cache),
        overhead_request(tvm_scope),
        tune_request(Diamond, GRAPH, (0,), tvm_scope, 8, 30.0),
        plan_request(tvm.ir.save_json(Diamond), plan, INPUTS, FAST, fresh=True),
        compare_request(tvm.ir.save_json(Diamond), {"partune": plan}, peers, INPUTS, rounds=1),
        capture_request(
            Path("/tmp/model.json"), INPUTS, ["onnxruntime", "tvm"], Path("/tmp/values.npz")
        ),
        BuildRequest.of(region, cache),
    ]


def replies() -> list:
    m = Measurement(1e-4, 1e-6, 1e-4, 7, 10, load=0.5, best_s=9e-5, peak_bytes=1 << 20)
    failed = Measurement.failed("RuntimeError: no")
    return [
        MeasurementReply(m),
        MeasurementReply(m, BuildInfo("hit", 0.25)),
        MeasurementReply(failed, trace="Traceback ..."),
        MeasurementsReply({"a": m, "b": failed}),
        TuningReply(REPORT),
        BuildReply(BuildInfo("stored", 1.5)),
        BuildReply(BuildInfo("not cached by this backend")),
        CaptureReply("/tmp/values.npz"),
        ErrorReply("worker crashed (signal SIGSEGV)"),
    ]


def _through_text(message: dict) -> dict:
    return json.loads(json.dumps(message))


@pytest.mark.parametrize("index", range(len(requests())))
def test_every_request_round_trips_through_json(index):
    req = requests()[index]
    data = req.to_json()
    assert data["kind"] == req.kind and _through_text(data) == data  # JSON as it is
    back = request_from_json(_through_text(data))
    assert type(back) is type(req) and back == req and back.to_json() == data


@pytest.mark.parametrize("index", range(len(replies())))
def test_every_reply_round_trips_through_json(index):
    reply = replies()[index]
    data = reply.to_json()
    back = reply_from_json(_through_text(data))
    assert type(back) is type(reply) and back == reply and back.to_json() == data


def test_every_kind_is_covered_and_the_wrong_kind_is_refused():
    assert {type(r) for r in requests()} == set(REQUEST_TYPES.values())
    assert {type(r) for r in replies()} == set(REPLY_TYPES.values())
    with pytest.raises(ProtocolError):
        request_from_json({"kind": "nonsense"})
    with pytest.raises(ProtocolError):
        RegionRequest.from_json(requests()[4].to_json())  # a tune request is not a region request
    with pytest.raises(ProtocolError):
        reply_from_json({"kind": "measurement", "measurement": {}, "surprise": 1})


def _dict_request(mod, graph, nodes, scope, protocol, cache) -> dict:
    """A region request as the dict protocol made it (``region_request`` before the types)."""
    bindings = main_bindings(mod["main"])
    exits = [bindings[n].var for n in partition.region_exits(graph, set(nodes))]
    func, _, _ = partition.lift_region([bindings[n] for n in sorted(nodes)], exits, "region", {})
    return {
        "kind": "region",
        "backend": scope.backend,
        "scope": scope.to_json(),
        "module": {"text": tvm.ir.save_json(tvm.IRModule({"region": func}))},
        "function": "region",
        "protocol": protocol,
        "build_cache": cache,
    }


@pytest.mark.parametrize("backend", ["tvm", "onnxruntime"])
def test_the_build_cache_key_is_the_one_of_the_dict_requests(backend):
    """The key hashes the same fields the dict requests carried: entries stay valid."""
    scope = CONFIG.scope_for(backend)
    req = region_request(Diamond, GRAPH, (1, 2), scope, FAST, build_cache="/tmp/c")
    old = _dict_request(Diamond, GRAPH, (1, 2), scope, FAST, "/tmp/c")
    key = build_cache.request_key(old)
    assert build_cache.request_key(req.to_json()) == key
    assert (
        build_cache.request_key(BuildRequest.of(req, "/tmp/c").to_json()) == key
    )  # the pool's build
    for threads in (1, 3):
        assert (
            build_cache.entry_for(replace(req, threads=threads).to_json(), False).key
            == build_cache.entry_for(old | {"threads": threads}, False).key
        )
    new = req.to_json()
    assert {k: new[k] for k in old if k != "protocol"} == {
        k: v for k, v in old.items() if k != "protocol"
    }
    assert new["protocol"] == asdict(Protocol(**FAST))


def _answer(req):
    """``req`` answered through the RPC entry (JSON text both ways)."""
    return reply_from_json(json.loads(handle_json(json.dumps(req.to_json()))))


def test_every_request_kind_through_handle_json(tmp_path, tunereport):
    cache = str(tmp_path)
    region, _, captured, overhead, _, plan, compare, _, build = requests(cache)
    for req in (region, captured, overhead):
        reply = _answer(req)
        assert isinstance(reply, MeasurementReply) and reply.measurement.ok, reply
        assert reply.build is not None and reply.build.build_s is not None
    assert _answer(captured).build.cache == "miss"
    assert _answer(BuildRequest.of(captured, cache)).build.cache == "stored"
    assert _answer(captured).build.cache == "hit"
    reply = _answer(plan)
    assert isinstance(reply, MeasurementReply) and reply.measurement.ok, reply
    reply = _answer(compare)
    assert isinstance(reply, MeasurementsReply) and list(reply.measurements) == list(
        compare.contenders
    )
    assert (
        reply.measurements["partune"].ok
        and "no export" in reply.measurements["onnxruntime (export)"].error
    )
    tune = tune_request(Diamond, GRAPH, (0,), tunereport, 8, 30.0)
    assert _answer(tune) == TuningReply(REPORT | {"trials": 8}) == handle(tune)
    assert _answer(build).build.cache == "stored"
    assert _answer(replace(build, backend="torch")) == BuildReply(
        BuildInfo("not cached by this backend")
    )
    capture = capture_request(
        module_file.write(Diamond, tmp_path), INPUTS, ["onnxruntime"], tmp_path / "v.npz"
    )
    assert (
        _answer(capture) == CaptureReply(str(tmp_path / "v.npz")) and (tmp_path / "v.npz").exists()
    )


def test_python_errors_become_failed_measurements_or_error_replies():
    region = requests()[0]
    for reply in (
        handle(replace(region, backend="nope")),
        _answer(replace(region, backend="nope")),
    ):
        assert isinstance(reply, MeasurementReply) and "nope" in reply.measurement.error
        assert reply.trace and "Traceback" in reply.trace
    failed = _answer(tune_request(Diamond, GRAPH, (0,), CONFIG.scope_for("tvm"), 8, 30.0))
    assert isinstance(failed, MeasurementReply) and "nothing to tune" in failed.measurement.error
    assert isinstance(_answer(replace(requests()[-1], backend="nope")), ErrorReply)
    unreadable = reply_from_json(json.loads(handle_json(json.dumps({"kind": "nonsense"}))))
    assert isinstance(unreadable, MeasurementReply) and "nonsense" in unreadable.measurement.error
    assert isinstance(
        reply_from_json(json.loads(handle_json(json.dumps({"kind": "build"})))), ErrorReply
    )


class Scripted(Runner):
    """A runner whose worker answers with the replies it is given."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)

    def exchange(self, request, timeout_s=None):
        return self.answers.pop(0)


def test_the_runner_reads_replies_by_type():
    ok = Measurement(1e-4, 0.0, 1e-4, 1, 1)
    region, compare, tune = requests()[0], requests()[6], requests()[4]
    assert Scripted(MeasurementReply(ok, BuildInfo("off", 0.1))).run(region) == ok
    assert Scripted(ErrorReply("timed out after 3 s")).run(region).error == "timed out after 3 s"
    labels = list(compare.contenders)
    assert Scripted(MeasurementsReply({"x": ok})).compare(compare) == {"x": ok}
    for why, reply in (
        ("worker crashed", ErrorReply("worker crashed")),
        ("ValueError: v", MeasurementReply(Measurement.failed("ValueError: v"))),
    ):
        got = Scripted(reply).compare(compare)
        assert list(got) == labels and all(m.error == why for m in got.values())
    assert Scripted(TuningReply(REPORT)).tune(tune, 10) == REPORT
    assert Scripted(ErrorReply("rpc: gone")).tune(tune, 10) == {"error": "rpc: gone"}
    assert Scripted(MeasurementReply(Measurement.failed("E: x"))).tune(tune, 10) == {
        "error": "E: x"
    }


def test_a_model_named_by_its_file_is_read_there_once_and_travels_as_text_to_a_remote_worker(
    tmp_path,
):
    """A whole model's requests name its file (0.58 GB of JSON at 12 BERT layers): the request
    stays small, the worker parses the file once while it is unchanged, and the RPC path,
    whose worker cannot read this machine's files, gets the text back in."""
    path = module_file.write(Diamond, tmp_path)
    plan = single_backend_plan("diamond", GRAPH, CONFIG, "onnxruntime", {0, 1})
    by_file = plan_request(path, plan, INPUTS, FAST)
    assert by_file.module == ModelRef(file=str(path))
    assert request_from_json(_through_text(by_file.to_json())) == by_file
    assert len(json.dumps(by_file.to_json())) < len(path.read_text())
    assert isinstance(reply := _answer(by_file), MeasurementReply) and reply.measurement.ok, reply
    peer = {"onnxruntime (export)": {"kind": "unavailable", "why": "no export"}}
    compared = _answer(compare_request(path, {**peer, "partune": plan}, {}, INPUTS, rounds=1))
    assert isinstance(compared, MeasurementsReply) and compared.measurements["partune"].ok
    assert "no export" in compared.measurements["onnxruntime (export)"].error
    assert not module_file._PARSED  # its plans built, a comparison holds the model no more
    first = module_file.load(by_file)
    assert module_file.load(by_file) is first  # parsed once
    inlined = module_file.inlined(by_file)
    assert inlined.module == ModelRef(text=tvm.ir.save_json(module_file.read(path)))
    assert (
        module_file.inlined(inlined) is inlined
        and module_file.inlined(requests()[0]) == requests()[0]
    )
    path.write_text(tvm.ir.save_json(Chain))  # a file that changed is read again
    assert tvm.ir.save_json(module_file.load(by_file)) == tvm.ir.save_json(Chain)


def test_a_region_request_may_name_the_models_file_and_the_worker_lifts_the_region(tmp_path):
    """A local worker reads the model's file, so a region request names it and its nodes
    instead of carrying the region's weights as JSON: the same region is measured, with the
    same inputs; its build has a key of its own per region and per file, the pool's build the
    same key; and the RPC path gets the region's text back in."""
    from partune.frontend.models import load
    from tests.model_files import write_mlp_onnx

    model = load(str(write_mlp_onnx(tmp_path / "mlp.onnx", layers=3, width=32)), {})
    path = module_file.write(model.mod, tmp_path)
    scope = CONFIG.scope_for("onnxruntime")
    values = {model.mod["main"].params[0]: np.ones((4, 32), "float32")}
    values |= {b.var: np.ones((4, 32), "float32") for b in main_bindings(model.mod["main"])}
    by_text = region_request(
        model.mod, model.graph, (3, 4, 5), scope, FAST, values, build_cache="/c"
    )
    by_file = region_request(
        model.mod, model.graph, (5, 4, 3), scope, FAST, values, build_cache="/c", model_file=path
    )
    assert (
        by_file.module == ModelRef(file=str(path), nodes=(3, 4, 5))
        and by_file.inputs == by_text.inputs
    )
    assert request_from_json(_through_text(by_file.to_json())) == by_file
    assert len(json.dumps(by_file.to_json())) < len(json.dumps(by_text.to_json())) / 4
    region = module_file.region(by_file)
    tvm.ir.assert_structural_equal(
        region, tvm.ir.load_json(by_text.module.text), map_free_vars=True
    )
    assert module_file.inlined(by_file) == replace(
        by_file, module=ModelRef(text=tvm.ir.save_json(region))
    )
    key = build_cache.request_key(by_file.to_json())
    assert key != build_cache.request_key(by_text.to_json())
    assert key == build_cache.request_key(BuildRequest.of(by_file, "/c").to_json())
    assert key != build_cache.request_key(
        replace(by_file, module=ModelRef(file=str(path), nodes=(3, 4))).to_json()
    )
    for req in (replace(by_text, build_cache=None), replace(by_file, build_cache=None)):
        assert isinstance(reply := _answer(req), MeasurementReply) and reply.measurement.ok, reply


def test_a_models_weights_go_to_a_parameter_file_and_come_back_bound(tmp_path):
    """Large constants are written as binary parameters, not as base64 inside the JSON (0.58 GB
    of text at 12 BERT layers): the JSON stays small, and the model read back is the model
    written, in structure, in its dataflow graph and in what it computes; small constants stay."""
    from partune.frontend.models import load
    from tests.model_files import write_mlp_onnx

    mod = load(str(write_mlp_onnx(tmp_path / "mlp.onnx", layers=3, width=32)), {}).mod
    structure, params = module_file.lift_constants(mod)
    assert len(params) == 3 and all(
        a.shape == (32, 32) for a in params.values()
    )  # the 4 KB weights, not the biases
    path = module_file.write(mod, tmp_path)
    assert path.with_suffix(".params").stat().st_size > 3 * 32 * 32 * 4 > len(path.read_text()) / 2
    back = module_file.read(path)
    tvm.ir.assert_structural_equal(back, mod, map_free_vars=True)
    before, after = (
        DataflowGraph.from_function(mod["main"]),
        DataflowGraph.from_function(back["main"]),
    )
    assert after.nodes == before.nodes and after.fingerprint == before.fingerprint
    assert module_file.lift_constants(Diamond) == (
        Diamond,
        {},
    )  # nothing to lift: the module itself
    run = {name: tvm.compile(m, "llvm") for name, m in (("before", mod), ("after", back))}
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((4, 32)).astype("float32"))
    outs = {
        name: tvm.relax.VirtualMachine(lib, tvm.cpu())["main"](x).numpy()
        for name, lib in run.items()
    }
    np.testing.assert_array_equal(outs["before"], outs["after"])


def test_a_peers_onnx_file_is_read_where_it_is_built_and_inlined_for_a_remote_worker(tmp_path):
    """The peers' ONNX model travels as a file name (two peers carried 2 GB of base64 at 24
    BERT layers); built from it, a peer computes what the carried one does."""
    from partune.frontend.models import load
    from partune.runners.peers import make_peer, peer_label, peer_specs
    from tests.model_files import write_onnx

    model = load(str(write_onnx(tmp_path / "tiny.onnx")), {"x": (1, 3, 16, 16)})
    folder = tmp_path / "scratch"
    folder.mkdir()
    by_file = peer_specs(model, ("onnxruntime", "openvino"), folder)
    assert all(set(spec) == {"kind", "onnx_file"} for spec in by_file.values())
    # The user's own file is named, not copied (nor held by the search: ``Model.onnx_bytes``).
    assert {spec["onnx_file"] for spec in by_file.values()} == {str(tmp_path / "tiny.onnx")}
    assert not any(folder.iterdir())
    remote = module_file.inlined(compare_request("{}", {}, by_file, model.inputs))
    data = base64.b64encode((tmp_path / "tiny.onnx").read_bytes()).decode()
    assert remote.contenders == {
        label: {"kind": spec["kind"], "onnx": data} for label, spec in by_file.items()
    }
    label = peer_label("onnxruntime", model)
    np.testing.assert_allclose(
        np.asarray(make_peer(by_file[label], model.inputs, 1)()[0]),
        np.asarray(make_peer(remote.contenders[label], model.inputs, 1)()[0]),
        rtol=1e-6,
    )


def test_a_message_of_another_wire_version_is_refused_naming_both():
    from partune.runners.protocol import PROTOCOL_VERSION

    data = requests()[0].to_json()
    assert data["version"] == PROTOCOL_VERSION
    old = {k: v for k, v in data.items() if k != "version"}  # as a Partune before versions wrote it
    with pytest.raises(
        ProtocolError, match=f"version 1; this Partune speaks version {PROTOCOL_VERSION}"
    ):
        request_from_json(old)
    reply = reply_from_json(
        json.loads(handle_json(json.dumps(data | {"version": PROTOCOL_VERSION + 1})))
    )
    assert (
        f"version {PROTOCOL_VERSION + 1}" in failure_of(reply)
        and len(failure_of(reply).splitlines()) == 1
    )


def test_a_model_reference_is_text_or_a_file_and_nodes_only_of_a_file():
    assert ModelRef.of("{}") == ModelRef(text="{}") and ModelRef.of(Path("/m.json")) == ModelRef(
        file="/m.json"
    )
    region = ModelRef(file="/m.json", nodes=(1, 2))
    assert ModelRef.from_json(json.loads(json.dumps(region.to_json()))) == region
    for bad in (
        {},
        {"text": "{}", "file": "/m.json"},
        {"text": "{}", "nodes": [1]},
        {"path": "/m.json"},
        "{}",
    ):
        with pytest.raises(ProtocolError):
            ModelRef.from_json(bad)
    data = requests()[0].to_json()
    with pytest.raises(ProtocolError, match="model reference"):
        request_from_json(data | {"module": "{}"})  # the version-2 string, read as a reference
