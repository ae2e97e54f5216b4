"""DataflowGraph: the bindings of a Relax ``main`` as an indexed graph.

Partition rules, plans and the cost model all speak in node indices of this graph, so
it is the one place that knows how Relax bindings map to nodes. Nodes are in post-DFS
(binding) order, which is a topological order: every producer has a smaller index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import tvm
from tvm import relax

from partune.core.keys import GRAPH_DIGITS, digest, node_key_parts
from partune.core.tensors import known_shape, tensor_types


class OpKind(IntEnum):
    """TVM's op-pattern kinds, ordered as TVM orders them (fusion decisions compare them)."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    REDUCTION = 3
    OUT_ELEMWISE_FUSABLE = 4
    TUPLE = 7
    OPAQUE = 8


_ELEMWISE_OPS = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "floor_divide",
    "power",
    "maximum",
    "minimum",
    "nn.relu",
    "nn.gelu",
    "nn.gelu_tanh",
    "nn.silu",
    "sigmoid",
    "tanh",
    "erf",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "clip",
    "negative",
    "abs",
    "where",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_not",
    "logical_and",
    "logical_or",
    "bitwise_and",
    "bitwise_or",
    "astype",
    "round",
    "floor",
    "ceil",
    "sin",
    "cos",
    "square",
}
_INJECTIVE_OPS = {
    "reshape",
    "permute_dims",
    "broadcast_to",
    "expand_dims",
    "squeeze",
    "concat",
    "split",
    "strided_slice",
    "take",
    "nn.pad",
    "full",
    "full_like",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "arange",
    "index_tensor",
    "flatten",
    "layout_transform",
    "tile",
    "repeat",
}
_REDUCTION_OPS = {"sum", "mean", "max", "min", "prod", "variance", "argmax", "argmin"}
_OUT_FUSABLE_OPS = {
    "nn.conv2d",
    "nn.conv1d",
    "matmul",
    "linear",
    "nn.max_pool2d",
    "nn.avg_pool2d",
    "nn.adaptive_avg_pool2d",
    "nn.conv2d_transpose",
}


def _short(op_name: str) -> str:
    return op_name[len("relax.") :] if op_name.startswith("relax.") else op_name


def _nbytes(t: relax.TensorType) -> int:
    shape = known_shape(t)
    if shape is None:
        return 0
    bits = tvm.runtime.DataType(t.dtype).bits if t.dtype else 32
    return math.prod(shape) * max(bits, 8) // 8


@dataclass(frozen=True)
class Node:
    """One binding of main: what it computes and what it reads."""

    index: int
    name: str
    op: str  # "add", "nn.conv2d", "tuple", "get_item", "const", "alias", ...
    kind: OpKind
    inputs: tuple[int, ...]  # indices of producer nodes (params and constants excluded)
    shapes: tuple[tuple[int, ...] | None, ...]  # one per tensor output
    dtypes: tuple[str, ...]
    flops: int
    bytes: int
    attrs: str  # op attributes as text: part of the fingerprint
    args: tuple[str, ...] = ()  # what each argument is: a node, a param or a constant, and its type
    out_bytes: int = 0  # what the node's result occupies: what crosses a border after it
    const_bytes: int = 0  # weights it reads (constants bound into the model)


def _op_name(value: relax.Expr) -> str:
    if isinstance(value, relax.Call):
        return _short(value.op.name) if isinstance(value.op, tvm.ir.Op) else "call"
    if isinstance(value, relax.Tuple):
        return "tuple"
    if isinstance(value, relax.TupleGetItem):
        return "get_item"
    if isinstance(value, tvm.ir.Constant):
        return "const"
    if isinstance(value, relax.Var):
        return "alias"
    return type(value).__name__.lower()


def _kind(op: str, in_shapes: list, out_shapes: list) -> OpKind:
    if op in _ELEMWISE_OPS:
        same = all(s == out_shapes[0] for s in in_shapes) if out_shapes else True
        return OpKind.ELEMWISE if same else OpKind.BROADCAST
    if op in _INJECTIVE_OPS or op in {"get_item", "const", "alias"}:
        return OpKind.INJECTIVE
    if op in _REDUCTION_OPS:
        return OpKind.REDUCTION
    if op in _OUT_FUSABLE_OPS:
        return OpKind.OUT_ELEMWISE_FUSABLE
    if op == "tuple":
        return OpKind.TUPLE
    return OpKind.OPAQUE


def _flops(op: str, value: relax.Expr, in_types: list, out_types: list) -> int:
    outs = [known_shape(t) for t in out_types]
    out_elems = sum(math.prod(s) for s in outs if s is not None)
    if op == "matmul" and len(in_types) == 2:
        a = known_shape(in_types[0])
        if a and outs and outs[0] is not None:
            return 2 * math.prod(outs[0]) * a[-1]
    if op in ("nn.conv2d", "nn.conv1d") and len(in_types) == 2:
        w = known_shape(in_types[1])  # OIHW
        if w and outs and outs[0] is not None:
            return 2 * math.prod(outs[0]) * math.prod(w[1:])
    if op in _ELEMWISE_OPS:
        return out_elems
    if op in _REDUCTION_OPS or op in ("nn.softmax", "nn.layer_norm", "nn.batch_norm"):
        return sum(math.prod(known_shape(t) or (0,)) for t in in_types[:1]) * (
            5 if op.startswith("nn.") else 1
        )
    if op in ("nn.max_pool2d", "nn.avg_pool2d", "nn.adaptive_avg_pool2d"):
        return sum(math.prod(known_shape(t) or (0,)) for t in in_types[:1])
    return 0


def _args(value: relax.Expr) -> list[relax.Expr]:
    if isinstance(value, relax.Call):
        return list(value.args)
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    if isinstance(value, relax.Var):
        return [value]
    return []


def _vars(args: list[relax.Expr]) -> list[relax.Var]:
    """Variables among ``args``, looking inside tuple arguments (``concat((a, b))``)."""
    out = []
    for a in args:
        if isinstance(a, relax.Var):
            out.append(a)
        elif isinstance(a, relax.Tuple):
            out.extend(_vars(list(a.fields)))
    return out


def _describe_arg(arg: relax.Expr, index: dict) -> str:
    if isinstance(arg, relax.Var):
        return "node" if arg in index else f"param:{arg.ty}"
    if isinstance(arg, tvm.ir.Constant):
        return f"const:{arg.ty}"
    if isinstance(arg, relax.Tuple):
        return "(" + ",".join(_describe_arg(f, index) for f in arg.fields) + ")"
    return str(arg)


def main_bindings(func: relax.Function) -> list[relax.Binding]:
    """All bindings of a function body, across its blocks, in order."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [b for block in body.blocks for b in block.bindings]


@dataclass(frozen=True)
class DataflowGraph:
    """Nodes of main in post-DFS order, plus which nodes feed main's result."""

    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]  # nodes whose values main returns
    param_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.index)
        return tuple(tuple(c) for c in out)

    @cached_property
    def reach(self) -> tuple[int, ...]:
        """Per node, a bitmask of the nodes reachable from it (itself included)."""
        down = [0] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            mask = 1 << i
            for c in self.consumers[i]:
                mask |= down[c]
            down[i] = mask
        return tuple(down)

    @cached_property
    def consumer_masks(self) -> tuple[int, ...]:
        """Per node, a bitmask of its consumers (sub-graph tests as mask operations)."""
        out = [0] * len(self.nodes)
        for n in self.nodes:
            for i in n.inputs:
                out[i] |= 1 << n.index
        return tuple(out)

    @cached_property
    def input_masks(self) -> tuple[int, ...]:
        """Per node, a bitmask of its producer nodes."""
        out = []
        for n in self.nodes:
            mask = 0
            for i in n.inputs:
                mask |= 1 << i
            out.append(mask)
        return tuple(out)

    @cached_property
    def output_mask(self) -> int:
        """The nodes whose values main returns, as a bitmask."""
        mask = 0
        for i in self.outputs:
            mask |= 1 << i
        return mask

    @cached_property
    def ancestors(self) -> tuple[int, ...]:
        """Per node, a bitmask of the nodes it is reachable from (itself included)."""
        up = [0] * len(self.nodes)
        for n in self.nodes:  # topological order: producers first
            mask = 1 << n.index
            for p in n.inputs:
                mask |= up[p]
            up[n.index] = mask
        return tuple(up)

    @cached_property
    def key_parts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Per node, the JSON text its entry in a region key is made of
        (``keys.node_key_parts``)."""
        return node_key_parts(self)

    @cached_property
    def region_key_memo(self) -> dict[tuple[int, ...], str]:
        """Region keys computed on this graph, by node tuple (``keys.region_key`` fills it)."""
        return {}

    @cached_property
    def fingerprint(self) -> str:
        """Stable across processes: ops, attributes, shapes, dtypes and edges."""
        doc = [
            self.param_names,
            self.outputs,
            [(n.op, n.attrs, n.inputs, n.shapes, n.dtypes) for n in self.nodes],
        ]
        return digest(doc, GRAPH_DIGITS)

    @classmethod
    def from_function(cls, func: relax.Function) -> DataflowGraph:
        index: dict[relax.Var, int] = {}
        nodes = []
        for i, binding in enumerate(main_bindings(func)):
            value = binding.value
            op = _op_name(value)
            args = _args(value)
            in_types = [
                t
                for a in args
                if isinstance(a, relax.Expr) and hasattr(a, "ty")
                for t in tensor_types(a.ty)
            ]
            out_types = tensor_types(binding.var.ty)
            inputs = tuple(dict.fromkeys(index[a] for a in _vars(args) if a in index))
            attrs = (
                str(value.attrs)
                if isinstance(value, relax.Call) and value.attrs is not None
                else ""
            )
            arg_desc = tuple(_describe_arg(a, index) for a in args)
            if op == "get_item":
                attrs = str(value.index)
            out_bytes = sum(_nbytes(t) for t in out_types)
            nodes.append(
                Node(
                    index=i,
                    name=binding.var.name,
                    op=op,
                    kind=_kind(
                        op, [known_shape(t) for t in in_types], [known_shape(t) for t in out_types]
                    ),
                    inputs=inputs,
                    shapes=tuple(known_shape(t) for t in out_types),
                    dtypes=tuple(str(t.dtype) for t in out_types),
                    flops=_flops(op, value, in_types, out_types),
                    bytes=sum(_nbytes(t) for t in in_types) + out_bytes,
                    attrs=attrs,
                    args=arg_desc,
                    out_bytes=out_bytes,
                    const_bytes=sum(
                        _nbytes(t)
                        for a in args
                        if isinstance(a, tvm.ir.Constant)
                        for t in tensor_types(a.ty)
                    ),
                )
            )
            index[binding.var] = i
        result = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
        outs = [index[v] for v in _vars([result]) if v in index]
        return cls(tuple(nodes), tuple(dict.fromkeys(outs)), tuple(p.name for p in func.params))

    def describe(self, indices: list[int] | None = None) -> str:
        """One line per node, for people reading a plan."""
        rows = []
        for n in self.nodes if indices is None else (self.nodes[i] for i in indices):
            rows.append(
                f"{n.index:4d} {n.name:>8} = {n.op:<22} {n.kind.name:<20} <- {list(n.inputs)}"
            )
        return "\n".join(rows)
