"""The keys under which measurements are stored, and the digests they are made of.

Stores outlive Partune versions, so these bytes never change: ``tests/test_store_keys.py``
pins them. Digest lengths are part of the keys and are named here, once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from partune.core.scopes import SEScope

KEY_DIGITS = 24  # region, plan and verdict keys
GRAPH_DIGITS = 16  # a model's graph fingerprint
FINGERPRINT_DIGITS = 12  # a device fingerprint


class KeyedGraph(Protocol):
    """What the keys read of a ``DataflowGraph`` (typed so, the graph, which digests its own
    fingerprint here, and this module do not import each other)."""

    nodes: Sequence[Any]
    outputs: Sequence[int]
    consumers: Sequence[Sequence[int]]
    region_key_memo: dict[tuple[int, ...], str]
    key_parts: tuple[tuple[str, ...], tuple[str, ...]]


class KeyedPlan(Protocol):
    """What ``plan_key`` reads of a ``Plan``."""

    fingerprint: str
    regions: Sequence[Any]
    model_file: Any
    calibration: Any


def digest(doc: Any, digits: int, *, sort_keys: bool = False) -> str:
    """The first ``digits`` hex digits of the SHA-256 of ``doc`` as JSON (other values as str)."""
    return hashlib.sha256(json.dumps(doc, sort_keys=sort_keys, default=str).encode()).hexdigest()[
        :digits
    ]


def region_key(graph: KeyedGraph, nodes: tuple[int, ...]) -> str:
    """Structural key of a region: ops, attributes, shapes, dtypes and internal edges.

    Weights' values and node numbers do not enter it, so the same layer repeated in a
    model, or in another model, is measured once.

    The digest is of ``json.dumps`` of one ``(op, attrs, shapes, dtypes, args, ins, exit)``
    entry per node (``ins``: ``i<position>`` for an input inside the region, ``x<shapes><dtypes>``
    for one outside). Each node's JSON text, all but ``ins`` and ``exit``, is made once per
    graph (``DataflowGraph.key_parts``) and each region's key once per graph (memoised), so
    thousands of candidates over repeated layers cost a few string joins each.
    """
    memo = graph.region_key_memo
    nodes = tuple(nodes)
    if (key := memo.get(nodes)) is not None:
        return key
    head, outside = graph.key_parts
    pos = {n: i for i, n in enumerate(nodes)}
    consumers, outputs = graph.consumers, set(graph.outputs)
    doc = []
    for n in nodes:
        ins = ", ".join(f'"i{pos[p]}"' if p in pos else outside[p] for p in graph.nodes[n].inputs)
        exit_ = n in outputs or any(c not in pos for c in consumers[n])
        doc.append(f"{head[n]}, [{ins}], {'true' if exit_ else 'false'}]")
    key = hashlib.sha256(("[" + ", ".join(doc) + "]").encode()).hexdigest()[:KEY_DIGITS]
    memo[nodes] = key
    return key


def node_key_parts(graph: KeyedGraph) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Per node, the JSON text ``region_key`` digests: the entry's opening up to its ``args``
    (``[op, attrs, shapes, dtypes, args``), and the node as an input from outside the region."""
    head = tuple(
        json.dumps([n.op, n.attrs, n.shapes, n.dtypes, n.args], default=str)[:-1]
        for n in graph.nodes
    )
    outside = tuple(json.dumps(f"x{n.shapes}{n.dtypes}") for n in graph.nodes)
    return head, outside


def candidate_key(graph: KeyedGraph, nodes: tuple[int, ...], scope: SEScope) -> str:
    """A region under a scope: the key of its isolated measurement. An int8 region's key names
    the quantization scheme too (``INT8_SCHEME``): which of its ops run in int8 is the scheme's,
    so a region measured under another scheme is measured again (f32 keys stay as they were)."""
    key = "region:" + region_key(graph, nodes) + ":" + json.dumps(scope.to_json(), sort_keys=True)
    if scope.compute_precision != "int8":
        return key
    from partune.core.int8 import INT8_SCHEME  # only int8 keys need TVM's import

    return key + ":" + INT8_SCHEME


def plan_key(plan: KeyedPlan) -> str:
    """A whole plan: the key of its end-to-end measurement."""
    doc = [plan.fingerprint, sorted((list(r.nodes), r.scope.to_json()) for r in plan.regions)]
    if plan.model_file is not None:  # (partitioned plans keep the keys they always had)
        doc.append(plan.model_file.to_json())
    if plan.calibration is not None:  # int8 plans: the values depend on the calibration
        units = list(plan.calibration.f32_units)
        doc.append({"calibration": plan.calibration.digest} | ({"f32": units} if units else {}))
    return "plan:" + digest(doc, KEY_DIGITS, sort_keys=True)


def verdict_key(graph_fingerprint: str, plan_keys: dict[str, str], peers: Sequence[str]) -> str:
    """The prefix of one verdict's measurements (one per contender label follows it).

    ``plan_keys`` maps each finalist's label to its plan's key: the labels are part of the
    verdict, since its measurements are stored under them. (One search may call the same
    plan "partune dp" and another "partune dp (f32)"; keyed by plans alone, the second found
    the verdict done but its own labels never stored, and waited for ever.)"""
    return (
        "verdict:"
        + digest([graph_fingerprint, sorted(plan_keys.items()), sorted(peers)], KEY_DIGITS)
        + ":"
    )


def calibration_keys(scope: SEScope) -> tuple[str, str]:
    """The keys of a scope's calibration: its isolated call, and its call inside a model."""
    tag = json.dumps(scope.to_json(), sort_keys=True)
    return "overhead:" + tag, "transition:" + tag
