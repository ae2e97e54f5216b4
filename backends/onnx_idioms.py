"""Put back the fused ONNX ops that importing to Relax took apart.

Relax has no HardSwish, HardSigmoid or GlobalAveragePool: its importers spell them as
add/clip/divide/multiply chains and a mean over the spatial axes. Translated back
literally, those chains cost a graph-level runtime what the original op did not: on
mobilenet-v3-small, onnxruntime runs the literal translation 1.36x slower than the
user's own file, because its NCHWc layout pass and Conv+activation fusion know
HardSigmoid, HardSwish and GlobalAveragePool but not the chains (every unknown op
costs a reorder back to NCHW and out again). ``fuse_idioms`` rewrites the chains into
the ops, exactly (same formula, constants checked), and leaves everything else alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

Rewrite = Callable[["_View", onnx.NodeProto], bool]


class _View:
    """The graph's nodes with producers, use counts and constant values, kept current."""

    def __init__(self, graph: onnx.GraphProto, ranks: dict[str, int]) -> None:
        self.graph = graph
        self.rank = ranks
        self.consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer
                       if int(np.prod(t.dims)) <= 16}
        self.outputs = {o.name for o in graph.output}
        self.nodes: list[onnx.NodeProto] = list(graph.node)
        self.refresh()

    def refresh(self) -> None:
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.uses = Counter(i for n in self.nodes for i in n.input)

    def const(self, name: str) -> float | None:
        """The value of a scalar (or all-equal) constant input, else None."""
        arr = self.consts.get(name)
        if arr is None or arr.size == 0 or not np.all(arr == arr.flat[0]):
            return None
        return float(arr.flat[0])

    def only_use(self, name: str) -> bool:
        """Whether ``name`` feeds exactly one node and is not a graph output: safe to fold."""
        return self.uses[name] == 1 and name not in self.outputs

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and self.only_use(name) else None

    def split(self, node: onnx.NodeProto) -> tuple[str, float] | None:
        """A binary node with one scalar-constant input: (the other input, the constant)."""
        a, b = node.input
        if (c := self.const(b)) is not None:
            return a, c
        if node.op_type in ("Add", "Mul") and (c := self.const(a)) is not None:
            return b, c
        return None

    def replace(self, old: list[onnx.NodeProto], new: onnx.NodeProto) -> None:
        """Swap the chain ``old`` (last node first) for ``new``, at the last node's place."""
        at = self.nodes.index(old[0])
        self.nodes[at] = new
        for n in old[1:]:
            self.nodes.remove(n)
        self.refresh()


def _clip_bounds(view: _View, node: onnx.NodeProto) -> tuple[float, float] | None:
    if node.op_type != "Clip" or len(node.input) != 3:
        return None
    lo, hi = view.const(node.input[1]), view.const(node.input[2])
    return None if lo is None or hi is None else (lo, hi)


def _relu6_of_plus3(view: _View, name: str) -> tuple[str, list[onnx.NodeProto]] | None:
    """``clip(x + 3, 0, 6)``: returns x and the two nodes."""
    clip = view.made_by(name, "Clip")
    if clip is None or _clip_bounds(view, clip) != (0.0, 6.0):
        return None
    add = view.made_by(clip.input[0], "Add")
    if add is None or (s := view.split(add)) is None or s[1] != 3.0:
        return None
    return s[0], [clip, add]


def _hard_sigmoid(view: _View, node: onnx.NodeProto) -> bool:
    """``clip(a*x + b, 0, 1)`` and ``clip(x + 3, 0, 6) / 6`` become HardSigmoid."""
    if node.op_type == "Clip" and _clip_bounds(view, node) == (0.0, 1.0):
        add = view.made_by(node.input[0], "Add")
        if add is None or (s := view.split(add)) is None:
            return False
        mul = view.made_by(s[0], "Mul")
        if mul is None or (m := view.split(mul)) is None:
            return False
        view.replace([node, add, mul], helper.make_node(
            "HardSigmoid", [m[0]], [node.output[0]], alpha=m[1], beta=s[1]))
        return True
    if node.op_type in ("Div", "Mul") and (s := view.split(node)) is not None:
        scale = 1.0 / s[1] if node.op_type == "Div" else s[1]
        if not np.isclose(scale, 1.0 / 6.0, rtol=1e-6) or (r := _relu6_of_plus3(view, s[0])) is None:
            return False
        x, chain = r
        view.replace([node, *chain], helper.make_node(
            "HardSigmoid", [x], [node.output[0]], alpha=1.0 / 6.0, beta=0.5))
        return True
    return False


def _hard_swish(view: _View, node: onnx.NodeProto) -> bool:
    """``x * hardsigmoid(x; 1/6, 1/2)`` and ``x * clip(x + 3, 0, 6) / 6`` become HardSwish."""
    if node.op_type == "Mul":
        for x, other in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            hs = view.made_by(other, "HardSigmoid")
            if hs is None or hs.input[0] != x:
                continue
            attrs = {a.name: a.f for a in hs.attribute}
            if np.isclose(attrs.get("alpha", 0.2), 1 / 6, rtol=1e-6) and np.isclose(attrs.get("beta", 0.5), 0.5):
                view.replace([node, hs], helper.make_node("HardSwish", [x], [node.output[0]]))
                return True
    if node.op_type == "Div" and (s := view.split(node)) is not None and s[1] == 6.0:
        mul = view.made_by(s[0], "Mul")
        if mul is None:
            return False
        for x, other in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            r = _relu6_of_plus3(view, other)
            if r is not None and r[0] == x:
                view.replace([node, mul, *r[1]], helper.make_node("HardSwish", [x], [node.output[0]]))
                return True
    return False


def _global_pool(view: _View, node: onnx.NodeProto) -> bool:
    """A mean (max) over every spatial axis, dims kept, becomes GlobalAverage(Max)Pool."""
    op = {"ReduceMean": "GlobalAveragePool", "ReduceMax": "GlobalMaxPool"}.get(node.op_type)
    if op is None or len(node.input) != 1:
        return False
    attrs = {a.name: a for a in node.attribute}
    rank = view.rank.get(node.input[0])
    if rank is None or rank < 3 or "axes" not in attrs or attrs.get("keepdims") and attrs["keepdims"].i == 0:
        return False
    if sorted(a % rank for a in attrs["axes"].ints) != list(range(2, rank)):
        return False
    view.replace([node], helper.make_node(op, [node.input[0]], [node.output[0]]))
    return True


REWRITES: tuple[Rewrite, ...] = (_hard_sigmoid, _hard_swish, _global_pool)


def fuse_idioms(model: onnx.ModelProto, ranks: dict[str, int]) -> onnx.ModelProto:
    """``model`` with the chains above replaced by their fused ops (in place, returned).

    ``ranks`` gives the rank of each value (the translator knows every type). Rewrites
    run to a fixed point: a HardSigmoid made by one is what HardSwish's rewrite looks for.
    """
    view = _View(model.graph, ranks)
    changed = True
    while changed:
        changed = False
        for node in list(view.nodes):
            if node in view.nodes and any(rw(view, node) for rw in REWRITES):
                changed = True
    del model.graph.node[:]
    model.graph.node.extend(view.nodes)
    return model
