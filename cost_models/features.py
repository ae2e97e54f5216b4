"""Features of a (region, SEScope) pair: what a cost model learns region costs from.

Deterministic and versioned: the vector depends only on the region's structure (ops,
kinds, shapes, dtypes, edges) and its backend, never on node numbers or weights' values,
so the same layer in two models gets the same vector (as it gets the same store key).
Bump ``FEATURE_VERSION`` whenever the layout changes: a saved model is only used with
the version it was trained on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from partune.core import DataflowGraph, OpKind, SubGraph

FEATURE_VERSION = 1
OPS = (
    "nn.conv2d",
    "matmul",
    "add",
    "multiply",
    "subtract",
    "divide",
    "nn.relu",
    "clip",
    "sigmoid",
    "tanh",
    "erf",
    "exp",
    "power",
    "sqrt",
    "rsqrt",
    "nn.gelu",
    "nn.silu",
    "nn.softmax",
    "nn.layer_norm",
    "nn.batch_norm",
    "mean",
    "sum",
    "max",
    "nn.max_pool2d",
    "nn.avg_pool2d",
    "nn.adaptive_avg_pool2d",
    "reshape",
    "permute_dims",
    "concat",
    "split",
    "strided_slice",
    "take",
    "astype",
    "where",
    "broadcast_to",
    "expand_dims",
    "squeeze",
    "get_item",
    "tuple",
    "const",
    "alias",
)
BACKENDS = ("tvm", "torch", "onnxruntime", "openvino")
KINDS = tuple(OpKind)
NAMES = (
    *(f"op:{o}" for o in OPS),
    "op:other",
    *(f"kind:{k.name.lower()}" for k in KINDS),
    "nodes",
    "log_flops",
    "log_bytes_in",
    "log_bytes_out",
    "log_weight_bytes",
    "log_largest",
    "intensity",
    "inputs",
    "exits",
    "depth",
    *(f"backend:{b}" for b in BACKENDS),
    "backend:other",
)


def _log(x: float) -> float:
    return math.log1p(max(x, 0.0))


def featurize(graph: DataflowGraph, nodes: Iterable[int], backend: str) -> np.ndarray:
    """The feature vector (``NAMES`` order) of ``nodes`` of ``graph`` run by ``backend``."""
    sub = SubGraph.of(graph, nodes)
    vec = dict.fromkeys(NAMES, 0.0)
    flops = weights = largest = 0
    for n in sub.nodes:
        node = graph.nodes[n]
        vec[f"op:{node.op}" if node.op in OPS else "op:other"] += 1
        vec[f"kind:{node.kind.name.lower()}"] += 1
        flops += node.flops
        weights += node.const_bytes
        largest = max([largest, *(math.prod(s) for s in node.shapes if s is not None)])
    bytes_in = sum(graph.nodes[p].out_bytes for p in sub.inputs)
    bytes_out = sum(graph.nodes[n].out_bytes for n in sub.exits)
    vec |= {
        "nodes": len(sub),
        "log_flops": _log(flops),
        "log_bytes_in": _log(bytes_in),
        "log_bytes_out": _log(bytes_out),
        "log_weight_bytes": _log(weights),
        "log_largest": _log(largest),
        "intensity": flops / (bytes_in + bytes_out + weights + 1),
        "inputs": len(sub.inputs),
        "exits": len(sub.exits),
        "depth": sub.depth,
    }
    vec[f"backend:{backend}" if backend in BACKENDS else "backend:other"] = 1.0
    return np.array([vec[k] for k in NAMES], dtype=np.float64)
