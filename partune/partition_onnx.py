"""The partition as an ONNX file: the model's Relax graph, each node labelled with its region.

People already read models in Netron; a plan is easiest to check there, on the model's
own graph. The graph is made by the shared Relax-to-ONNX exporter (``relax_to_onnx``), so
every input kind (zoo name, ONNX file, .pt2, TVMScript) gives one. Its per-binding hook
labels every ONNX node with the Relax binding that made it, and so with that binding's
plan region: one binding may become several ONNX nodes, and all of them carry its region.
A binding that makes no node of its own (a tuple, an alias, a tuple item, a constant) gets
an Identity, so every binding of the plan is visible and no region is missing from the file.

Each node carries ``metadata_props`` (``partune.backend``, ``partune.region``,
``partune.scope`` as JSON, ``partune.binding``, ``partune.op``), and its name starts with
the region (``r03_openvino/lv12``), which Netron shows on every node.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
from tvm import relax

from partune.backends import BackendError, relax_to_onnx
from partune.core import DataflowGraph, Plan

if TYPE_CHECKING:
    from partune.backends import OnnxGraph

FILE = "partition.onnx"
PREFIX = "partune."
BACKEND, REGION, SCOPE, BINDING, OP = (
    PREFIX + k for k in ("backend", "region", "scope", "binding", "op")
)
NODE_METADATA_IR = 10  # NodeProto.metadata_props is IR version 10 (ONNX 1.16)
EXTERNAL_ABOVE = 1_800_000_000  # bytes: past this a protobuf cannot hold the weights (2 GiB limit)


@dataclass(frozen=True)
class Written:
    """What ``write_partition_onnx`` did: the file, or why there is none."""

    path: Path | None
    nodes: int = 0
    reason: str | None = None


def region_prefix(index: int, backend: str, regions: int) -> str:
    """The name prefix of a region's nodes: ``r03_openvino`` (zero-padded to sort in order)."""
    return f"r{index:0{max(2, len(str(regions - 1)))}d}_{backend}"


def _names(value) -> list[str]:
    """The ONNX names of an exporter value (a name, or nested lists of names for a tuple)."""
    return [n for v in value for n in _names(v)] if isinstance(value, list) else [value]


def _restructure(value, names):
    """``value`` (a name or nested lists of names) with its names taken in order from ``names``."""
    if isinstance(value, list):
        return [_restructure(v, names) for v in value]
    return next(names)


def _set_props(node: onnx.NodeProto, props: dict[str, str]) -> None:
    del node.metadata_props[:]
    for key, value in props.items():
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value


class _Labeller:
    """The exporter's binding hook: names and annotates the ONNX nodes of each binding."""

    def __init__(self, plan: Plan, graph: DataflowGraph) -> None:
        self.graph = graph
        self.region_of = {n: k for k, r in enumerate(plan.regions) for n in r.nodes}
        self.props = [
            {
                BACKEND: r.backend,
                REGION: str(k),
                SCOPE: json.dumps(r.scope.to_json(), sort_keys=True),
            }
            for k, r in enumerate(plan.regions)
        ]
        self.prefixes = [
            region_prefix(k, r.backend, len(plan.regions)) for k, r in enumerate(plan.regions)
        ]

    def __call__(self, index: int, binding: relax.VarBinding, g: OnnxGraph, start: int) -> None:
        if len(g.nodes) == start:  # nothing of its own (a tuple, an alias): an Identity shows it
            names = iter([g.node("Identity", [name]) for name in _names(g.env[binding.var])])
            g.bind(binding.var, _restructure(g.env[binding.var], names))
        region = self.region_of[index]
        made = g.nodes[start:]
        for k, node in enumerate(made):
            suffix = f"/{k}" if len(made) > 1 else ""
            node.name = f"{self.prefixes[region]}/{binding.var.name}{suffix}"
            _set_props(
                node, self.props[region] | {BINDING: str(index), OP: self.graph.nodes[index].op}
            )


def _label_outputs(model: onnx.ModelProto) -> None:
    """The exporter's closing Identity per graph output belongs to the region that made the
    value."""
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.name:
            continue
        source = producer.get(node.input[0]) if node.input else None
        if source is not None and source.name:
            node.name = f"{source.name.split('/')[0]}/{node.output[0]}"
            _set_props(
                node,
                {e.key: e.value for e in source.metadata_props if e.key not in (OP, BINDING)}
                | {OP: "output"},
            )


def _unique_names(model: onnx.ModelProto) -> None:
    """Relax names may repeat (TVMScript, inlined functions): ONNX node names should not."""
    seen: Counter[str] = Counter()
    for node in model.graph.node:
        seen[node.name] += 1
        if seen[node.name] > 1:
            node.name = f"{node.name}#{seen[node.name] - 1}"


def partition_onnx(plan: Plan, mod, graph: DataflowGraph) -> onnx.ModelProto:
    """The model's ``main`` as ONNX, every node labelled with its region of ``plan``.

    Raises ``BackendError`` when the exporter cannot translate an op of the model.
    """
    labeller = _Labeller(plan, graph)
    model = relax_to_onnx(mod["main"], on_binding=labeller)
    _label_outputs(model)
    _unique_names(model)
    model.ir_version = max(model.ir_version, NODE_METADATA_IR)
    model.graph.name = plan.model
    for key, value in (
        (PREFIX + "model", plan.model),
        (PREFIX + "fingerprint", plan.fingerprint),
        (PREFIX + "regions", str(len(plan.regions))),
        (PREFIX + "chosen_as", str(plan.notes.get("chosen_as", ""))),
    ):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return model


def write_partition_onnx(plan: Plan, model, out: Path) -> Written:
    """``out``/partition.onnx for ``model`` under ``plan``; a reason instead when the model's
    graph has an op the exporter does not translate (the file is a picture: never fatal)."""
    try:
        proto = partition_onnx(plan, model.mod, model.graph)
    except BackendError as e:
        return Written(None, reason=f"the ONNX exporter cannot translate this model: {e}")
    path = Path(out) / FILE
    big = proto.ByteSize() > EXTERNAL_ABOVE
    onnx.save_model(
        proto, str(path), save_as_external_data=big, location=FILE + ".data" if big else None
    )
    return Written(path, nodes=len(proto.graph.node))


def read_regions(proto: onnx.ModelProto) -> dict[int, dict]:
    """Per region read back from a partition ONNX: its backend, scope and binding indices."""
    regions: dict[int, dict] = {}
    for node in proto.graph.node:
        props = {e.key: e.value for e in node.metadata_props}
        if REGION not in props:  # (an output that is a graph input, returned as it came)
            continue
        entry = regions.setdefault(
            int(props[REGION]),
            {"backend": props[BACKEND], "scope": props[SCOPE], "bindings": set()},
        )
        if BINDING in props:
            entry["bindings"].add(int(props[BINDING]))
    return regions
