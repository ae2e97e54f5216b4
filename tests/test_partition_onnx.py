"""The partition as ONNX: every node names its backend and region, and each region's bindings
read back from the file are the plan's."""

from __future__ import annotations

import json

import onnx
import pytest

from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig
from partune.frontend.models import load
from partune.partition_onnx import (
    BACKEND,
    BINDING,
    OP,
    REGION,
    SCOPE,
    partition_onnx,
    read_regions,
    region_prefix,
    write_partition_onnx,
)
from tests.conftest import load_model
from tests.export_models import write_export
from tests.model_files import write_onnx, write_pt2, write_tvmscript

ORDER = ["tvm", "torch", "onnxruntime", "openvino"]
CONFIG = CompilationConfig.for_cpu(ORDER)


def rotating_plan(model, size: int = 3) -> Plan:
    """Regions of ``size`` consecutive nodes, backends taken in turn."""
    n = len(model.graph)
    regions = tuple(
        Region(tuple(range(s, min(s + size, n))), CONFIG.scope_for(ORDER[i % len(ORDER)]))
        for i, s in enumerate(range(0, n, size))
    )
    return Plan(model.name, model.graph.fingerprint, CONFIG, regions)


def check_read_back(model, plan: Plan, tmp_path) -> onnx.ModelProto:
    """Write the file, load it as a user would, and hold every annotation against the plan."""
    written = write_partition_onnx(plan, model, tmp_path)
    assert written.path is not None, written.reason
    proto = onnx.load(str(written.path))
    onnx.checker.check_model(proto)
    for node in proto.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        region = plan.regions[int(props[REGION])]
        assert props[BACKEND] == region.backend
        assert json.loads(props[SCOPE]) == region.scope.to_json()
        assert node.name.startswith(
            region_prefix(int(props[REGION]), region.backend, len(plan.regions)) + "/"
        )
        if BINDING in props:
            assert model.graph.nodes[int(props[BINDING])].op == props[OP]
    back = read_regions(proto)
    assert {k: v["bindings"] for k, v in back.items()} == {
        k: set(r.nodes) for k, r in enumerate(plan.regions)
    }
    assert {k: v["backend"] for k, v in back.items()} == {
        k: r.backend for k, r in enumerate(plan.regions)
    }
    assert len({n.name for n in proto.graph.node}) == len(proto.graph.node)  # names are unique
    return proto


def test_a_zoo_model_reads_back(tmp_path):
    model = load_model("bert-small")
    proto = check_read_back(model, rotating_plan(model, 9), tmp_path)
    # bindings that make no ONNX node of their own (main's result tuple) still show, as an Identity
    ops = {
        (n.op_type, {e.key: e.value for e in n.metadata_props}.get(OP)) for n in proto.graph.node
    }
    assert ("Identity", "tuple") in ops
    assert any(op == "LayerNormalization" for op, _ in ops)


def test_an_onnx_file_reads_back(tmp_path):
    model = load(str(write_onnx(tmp_path / "tiny.onnx")))
    proto = check_read_back(model, rotating_plan(model, 2), tmp_path)
    names = [n.name for n in proto.graph.node]
    assert names[0].startswith("r00_tvm/") and any(n.startswith("r01_torch/") for n in names)


def test_an_exported_file_keeps_one_node_per_binding(tmp_path):
    """HardSwish chains fuse in the backends' translation; here each binding keeps its own nodes,
    so a region boundary inside a chain is exact."""
    from partune.backends.relax_onnx import relax_to_onnx

    model = load(str(write_export("hardswish_hardsigmoid", tmp_path)))
    assert "HardSwish" in {n.op_type for n in relax_to_onnx(model.mod["main"]).graph.node}
    proto = check_read_back(model, rotating_plan(model, 1), tmp_path)
    assert "HardSwish" not in {n.op_type for n in proto.graph.node}


@pytest.mark.parametrize("write", [write_tvmscript, write_pt2])
def test_every_input_kind(tmp_path, write):
    path = write(tmp_path / ("m.py" if write is write_tvmscript else "m.pt2"))
    model = load(str(path))
    check_read_back(model, rotating_plan(model, 2), tmp_path)


def test_one_binding_many_nodes_share_its_region():
    model = load_model("bert-small")
    plan = rotating_plan(model, 9)
    proto = partition_onnx(plan, model.mod, model.graph)
    per_binding: dict[str, set[str]] = {}
    for node in proto.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        if BINDING in props:
            per_binding.setdefault(props[BINDING], set()).add(props[REGION])
    assert len(per_binding) == len(model.graph)
    assert len(proto.graph.node) > len(per_binding)  # some bindings made several nodes
    assert all(len(regions) == 1 for regions in per_binding.values())


def test_a_model_the_exporter_cannot_translate_gives_a_reason(tmp_path, monkeypatch):
    from partune import partition_onnx as module
    from partune.backends.base import BackendError

    def refuse(*args, **kwargs):
        raise BackendError("op relax.foo not supported")

    monkeypatch.setattr(module, "relax_to_onnx", refuse)
    model = load(str(write_onnx(tmp_path / "tiny.onnx")))
    written = write_partition_onnx(rotating_plan(model), model, tmp_path)
    assert written.path is None and "relax.foo" in written.reason
    assert not (tmp_path / module.FILE).exists()


def test_export_writes_it_beside_the_deploy_files(tmp_path):
    from partune.export import export

    model = load(str(write_onnx(tmp_path / "tiny.onnx")))
    scopes = CompilationConfig.for_cpu(["tvm", "onnxruntime"])
    plan = Plan(
        model.name,
        model.graph.fingerprint,
        scopes,
        (
            Region((0, 1, 2), scopes.scope_for("tvm")),
            Region(tuple(range(3, len(model.graph))), scopes.scope_for("onnxruntime")),
        ),
    )
    out = export(model, plan, tmp_path / "deploy")
    proto = onnx.load(str(out / "partition.onnx"))
    assert {k: v["bindings"] for k, v in read_regions(proto).items()} == {
        0: {0, 1, 2},
        1: set(range(3, len(model.graph))),
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert "partition.onnx" not in manifest["files"]  # a picture: not part of what loads
