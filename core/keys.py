"""The keys under which measurements are stored, and the digests they are made of.

Stores outlive Partune versions, so these bytes never change: ``tests/test_store_keys.py``
pins them. Digest lengths are part of the keys and are named here, once.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from partune.core.graph import DataflowGraph
    from partune.core.plan import Plan
    from partune.core.scopes import SEScope

KEY_DIGITS = 24  # region, plan and verdict keys
GRAPH_DIGITS = 16  # a model's graph fingerprint
FINGERPRINT_DIGITS = 12  # a device fingerprint


def digest(doc: Any, digits: int, *, sort_keys: bool = False) -> str:
    """The first ``digits`` hex digits of the SHA-256 of ``doc`` as JSON (other values as str)."""
    return hashlib.sha256(json.dumps(doc, sort_keys=sort_keys, default=str).encode()).hexdigest()[:digits]


def region_key(graph: DataflowGraph, nodes: tuple[int, ...]) -> str:
    """Structural key of a region: ops, attributes, shapes, dtypes and internal edges.

    Weights' values and node numbers do not enter it, so the same layer repeated in a
    model, or in another model, is measured once.
    """
    pos = {n: i for i, n in enumerate(nodes)}
    doc = []
    for n in nodes:
        node = graph.nodes[n]
        ins = [f"i{pos[p]}" if p in pos else f"x{graph.nodes[p].shapes}{graph.nodes[p].dtypes}"
               for p in node.inputs]
        exit_ = any(c not in pos for c in graph.consumers[n]) or n in graph.outputs
        doc.append((node.op, node.attrs, node.shapes, node.dtypes, node.args, ins, exit_))
    return digest(doc, KEY_DIGITS)


def candidate_key(graph: DataflowGraph, nodes: tuple[int, ...], scope: SEScope) -> str:
    """A region under a scope: the key of its isolated measurement."""
    return "region:" + region_key(graph, nodes) + ":" + json.dumps(scope.to_json(), sort_keys=True)


def plan_key(plan: Plan) -> str:
    """A whole plan: the key of its end-to-end measurement."""
    doc = [plan.fingerprint, sorted((list(r.nodes), r.scope.to_json()) for r in plan.regions)]
    if plan.model_file is not None:  # (partitioned plans keep the keys they always had)
        doc.append(plan.model_file.to_json())
    return "plan:" + digest(doc, KEY_DIGITS, sort_keys=True)


def verdict_key(graph_fingerprint: str, plan_keys: list[str], peers: list[str]) -> str:
    """The prefix of one verdict's measurements (one per contender label follows it)."""
    return "verdict:" + digest([graph_fingerprint, sorted(plan_keys), sorted(peers)], KEY_DIGITS) + ":"


def calibration_keys(scope: SEScope) -> tuple[str, str]:
    """The keys of a scope's calibration: its isolated call, and its call inside a model."""
    tag = json.dumps(scope.to_json(), sort_keys=True)
    return "overhead:" + tag, "transition:" + tag
