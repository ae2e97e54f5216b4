"""Put back the fused ONNX ops that importing to Relax took apart.

Relax has no HardSwish, HardSigmoid or GlobalAveragePool: its importers spell them as
add/clip/divide/multiply chains and a mean over the spatial axes. Translated back
literally, those chains cost a graph-level runtime what the original op did not: on
mobilenet-v3-small, onnxruntime runs the literal translation 1.36x slower than the
user's own file, because its NCHWc layout pass and Conv+activation fusion know
HardSigmoid, HardSwish and GlobalAveragePool but not the chains (every unknown op
costs a reorder back to NCHW and out again). ``fuse_idioms`` rewrites the chains into
the ops, exactly (same formula, constants checked), and leaves everything else alone.

The same holds for BatchNormalization that no conv absorbs (DenseNet's pre-activation
BN-ReLU-conv): Relax's DecomposeOpsForInference leaves subtract, divide, multiply, add per
channel, which ORT's NCHWc pass cannot take (a reorder out and back in around each, 1.2x
on densenet), while a BatchNormalization becomes an NCHWc depthwise conv with the ReLU fused.
And for InstanceNormalization (wav2vec2's group-norm front end, exported as
InstanceNormalization): the importer spells it mean, subtract, variance, add eps, sqrt,
divide, scale, shift; literally that is eight passes over the activation where ORT's kernel
makes two (wav2vec2: 116 us vs 280 us, 3.7% of the model). And for a ConvTranspose's bias,
which the import splits into an add that ORT, unlike a Conv's, does not fold back.

HardSwish and the HardSwish-shaped HardSigmoid (``clip(x + 3, 0, 6) / 6``, as both of TVM's
importers spell them) are onnxscript's own rules (``fuse_hardswish_rules``); the rewrites
below are the ones onnxscript has no rule for, each saying so in its docstring.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
import onnxscript.rewriter
from onnx import helper, numpy_helper
from onnxscript.rewriter.rules.common import fuse_hardswish_rules

Rewrite = Callable[["_View", onnx.NodeProto], bool]


class _View:
    """The graph's nodes with producers, use counts and constant values, kept current."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        ranks: dict[str, int],
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.graph = graph
        self.rank = ranks
        self.shape = shapes or {}
        self.consts = {
            t.name: numpy_helper.to_array(t)
            for t in graph.initializer
            if int(np.prod(t.dims)) <= 16
        }
        self.initializers = {t.name: t for t in graph.initializer}
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
        return (
            node if node is not None and node.op_type == op_type and self.only_use(name) else None
        )

    def split(self, node: onnx.NodeProto) -> tuple[str, float] | None:
        """A binary node with one scalar-constant input: (the other input, the constant)."""
        a, b = node.input
        if (c := self.const(b)) is not None:
            return a, c
        if node.op_type in ("Add", "Mul") and (c := self.const(a)) is not None:
            return b, c
        return None

    def consumer(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The one node reading ``name`` when it is an ``op_type`` and ``name`` is safe to fold."""
        if not self.only_use(name):
            return None
        node = next((n for n in self.nodes if name in n.input), None)
        return node if node is not None and node.op_type == op_type else None

    def array(self, name: str) -> np.ndarray | None:
        """The value of any initializer (large ones too), else None."""
        t = self.initializers.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def add_initializer(self, arr: np.ndarray, hint: str) -> str:
        name, i = hint, 0
        while name in self.initializers or name in self.producer:
            i += 1
            name = f"{hint}_{i}"
        t = numpy_helper.from_array(arr, name)
        self.graph.initializer.append(t)
        self.initializers[name] = t
        return name

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


def _hard_sigmoid(view: _View, node: onnx.NodeProto) -> bool:
    """``clip(a*x + b, 0, 1)`` becomes HardSigmoid(a, b): how TVM's ONNX importer spells any
    HardSigmoid; onnxscript's HardSigmoidFusion knows only the ``clip(x + 3, 0, 6) / 6`` form."""
    if node.op_type != "Clip" or _clip_bounds(view, node) != (0.0, 1.0):
        return False
    add = view.made_by(node.input[0], "Add")
    if add is None or (s := view.split(add)) is None:
        return False
    mul = view.made_by(s[0], "Mul")
    if mul is None or (m := view.split(mul)) is None:
        return False
    view.replace(
        [node, add, mul],
        helper.make_node("HardSigmoid", [m[0]], [node.output[0]], alpha=m[1], beta=s[1]),
    )
    return True


def _global_pool(view: _View, node: onnx.NodeProto) -> bool:
    """A mean (max) over every spatial axis, dims kept, becomes GlobalAverage(Max)Pool
    (onnxscript has no ReduceMean-to-pool rule)."""
    op = {"ReduceMean": "GlobalAveragePool", "ReduceMax": "GlobalMaxPool"}.get(node.op_type)
    if op is None or len(node.input) != 1:
        return False
    attrs = {a.name: a for a in node.attribute}
    rank = view.rank.get(node.input[0])
    if (
        rank is None
        or rank < 3
        or "axes" not in attrs
        or attrs.get("keepdims")
        and attrs["keepdims"].i == 0
    ):
        return False
    if sorted(a % rank for a in attrs["axes"].ints) != list(range(2, rank)):
        return False
    view.replace([node], helper.make_node(op, [node.input[0]], [node.output[0]]))
    return True


def _spatial_mean_of(view: _View, name: str, rank: int) -> str | None:
    """x when ``name``, used once, is a mean of x (of rank ``rank``) over every spatial axis
    with dims kept (a GlobalAveragePool, or a ReduceMean with those axes); else None."""
    node = view.producer.get(name)
    if node is None or not view.only_use(name):
        return None
    if node.op_type == "GlobalAveragePool":
        return node.input[0]
    if node.op_type != "ReduceMean" or len(node.input) != 1:
        return None
    attrs = {a.name: a for a in node.attribute}
    if "axes" not in attrs or ("keepdims" in attrs and attrs["keepdims"].i == 0):
        return None
    return (
        node.input[0]
        if sorted(a % rank for a in attrs["axes"].ints) == list(range(2, rank))
        else None
    )


def _channel_vector(view: _View, name: str, x_shape: tuple[int, ...]) -> np.ndarray | None:
    """A constant broadcasting along the channel axis of x only ((C, 1, ...) or (1, C, 1, ...)):
    its C values; else None."""
    arr = view.array(name)
    if arr is None or arr.dtype != np.float32:
        return None
    rank, c = len(x_shape), x_shape[1]
    want = [(c,) + (1,) * (rank - 2), (1, c) + (1,) * (rank - 2)]
    return arr.reshape(c) if arr.shape in want else None


def _instance_norm(view: _View, node: onnx.NodeProto) -> bool:
    """``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)``, means over the spatial axes, then
    optionally ``* scale + shift`` with per-channel constants, becomes InstanceNormalization
    (onnxscript has no normalisation-from-its-parts rule)."""
    if node.op_type != "Div":
        return False
    centred, denom = node.input
    sub = view.made_by(centred, "Sub")
    sqrt = view.made_by(denom, "Sqrt")
    if sub is None or sqrt is None:
        return False
    x = sub.input[0]
    shape = view.shape.get(x)
    if shape is None or len(shape) < 3 or _spatial_mean_of(view, sub.input[1], len(shape)) != x:
        return False
    add = view.made_by(sqrt.input[0], "Add")
    if add is None or (s := view.split(add)) is None or s[1] < 0:
        return False
    var, eps = s
    eps_name = add.input[1] if add.input[0] == var else add.input[0]
    if view.consts[eps_name].dtype != np.float32:  # the scale and shift made below are f32
        return False
    # the variance as the translator writes it: mean((x - mean(x)) * (x - mean(x)))
    mean_node = view.producer.get(var)
    sq_name = mean_node.input[0] if mean_node is not None else None
    if sq_name is None or _spatial_mean_of(view, var, len(shape)) != sq_name:
        return False
    sq = view.made_by(sq_name, "Mul")
    if sq is None or sq.input[0] != sq.input[1]:
        return False
    dev = view.producer.get(sq.input[0])
    if (
        dev is None
        or dev.op_type != "Sub"
        or view.uses[sq.input[0]] != 2
        or sq.input[0] in view.outputs
        or dev.input[0] != x
        or _spatial_mean_of(view, dev.input[1], len(shape)) != x
    ):
        return False
    chain = [
        node,
        sub,
        view.producer[sub.input[1]],
        sqrt,
        add,
        mean_node,
        sq,
        dev,
        view.producer[dev.input[1]],
    ]
    c = shape[1]
    scale, shift = np.ones(c, np.float32), np.zeros(c, np.float32)
    out = node.output[0]
    mul = view.consumer(out, "Mul")
    if (
        mul is not None
        and (
            v := _channel_vector(view, mul.input[1] if mul.input[0] == out else mul.input[0], shape)
        )
        is not None
    ):
        scale, out = v, mul.output[0]
        chain.insert(0, mul)
        shift_add = view.consumer(out, "Add")
        if (
            shift_add is not None
            and (
                b := _channel_vector(
                    view,
                    shift_add.input[1] if shift_add.input[0] == out else shift_add.input[0],
                    shape,
                )
            )
            is not None
        ):
            shift, out = b, shift_add.output[0]
            chain.insert(0, shift_add)
    inputs = [
        x,
        view.add_initializer(scale, f"{out}_scale"),
        view.add_initializer(shift, f"{out}_shift"),
    ]
    view.replace(chain, helper.make_node("InstanceNormalization", inputs, [out], epsilon=eps))
    return True


def _const_operand(view: _View, node: onnx.NodeProto, value: str) -> str | None:
    """The input of binary ``node`` that is not ``value``."""
    if list(node.input).count(value) != 1:
        return None
    return node.input[1] if node.input[0] == value else node.input[0]


def _batch_norm(view: _View, node: onnx.NodeProto) -> bool:
    """``(x - mean) / std [* gamma] [+ beta]`` with per-channel constants (std > 0) becomes
    BatchNormalization(x, gamma, beta, mean, std^2, epsilon=0): inference batch norm as
    Relax's DecomposeOpsForInference leaves it (sqrt(var + eps) folded into std). onnxscript's
    ``fuse_batchnorm_into_conv`` goes the other way (a BN into the conv before it); here no
    conv precedes, and ORT wants the BatchNormalization op itself."""
    if node.op_type != "Sub":
        return False
    x, m_name = node.input
    shape = view.shape.get(x)
    if shape is None or len(shape) < 3 or (mean := _channel_vector(view, m_name, shape)) is None:
        return False
    div = view.consumer(node.output[0], "Div")
    if div is None or div.input[0] != node.output[0]:
        return False
    std = _channel_vector(view, div.input[1], shape)
    if std is None or not np.all(std > 0) or not np.all(np.isfinite(std)):
        return False
    chain, out = [div, node], div.output[0]
    gamma, beta = np.ones_like(std), np.zeros_like(std)
    mul = view.consumer(out, "Mul")
    if (
        mul is not None
        and (g := _const_operand(view, mul, out)) is not None
        and (v := _channel_vector(view, g, shape)) is not None
    ):
        gamma, out = v, mul.output[0]
        chain.insert(0, mul)
    add = view.consumer(out, "Add")
    if (
        add is not None
        and (b := _const_operand(view, add, out)) is not None
        and (v := _channel_vector(view, b, shape)) is not None
    ):
        beta, out = v, add.output[0]
        chain.insert(0, add)
    inputs = [x] + [
        view.add_initializer(a, f"{out}_{k}")
        for k, a in (("scale", gamma), ("bias", beta), ("mean", mean), ("var", std * std))
    ]
    view.replace(chain, helper.make_node("BatchNormalization", inputs, [out], epsilon=0.0))
    return True


def _with_bias(view: _View, node: onnx.NodeProto, channels: int, rank: int) -> bool:
    """``node`` (a Conv or ConvTranspose with no bias) then ``+ bias`` per output channel becomes
    the node with its bias input."""
    add = view.consumer(node.output[0], "Add")
    if add is None or (b := _const_operand(view, add, node.output[0])) is None:
        return False
    bias = _channel_vector(view, b, (1, channels) + (1,) * (rank - 2))
    if bias is None:
        return False
    inputs = [*node.input, view.add_initializer(bias, f"{add.output[0]}_bias")]
    view.replace(
        [add, node],
        helper.make_node(
            node.op_type,
            inputs,
            list(add.output),
            name=node.name,
            **{a.name: helper.get_attribute_value(a) for a in node.attribute},
        ),
    )
    return True


def _conv_transpose_bias(view: _View, node: onnx.NodeProto) -> bool:
    """ConvTranspose then ``+ bias`` per output channel becomes ConvTranspose with its bias
    input, as the user's file had it: ORT folds a Conv's bias add but not a ConvTranspose's
    (a U-Net's decoder paid an extra pass over each upsampled map, 1.03x the file).
    onnxscript's ``remove_optional_bias`` rules only drop an all-zero bias; none adds one."""
    if node.op_type != "ConvTranspose" or len(node.input) != 2:
        return False
    weight = view.array(node.input[1])
    if weight is None:
        return False
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    return _with_bias(view, node, weight.shape[1] * group, weight.ndim)


def _int8_conv_bias(view: _View, node: onnx.NodeProto) -> bool:
    """A Conv of dequantized int8 weights (an int8 region, ``partune.core.int8``) then ``+ bias``
    becomes the Conv with its bias input: ORT folds a bias add into a float Conv itself, but an
    int8 unit (dequantize in, bias, ReLU, quantize out) it runs as one QLinearConv only with the
    bias inside; apart, the Conv ran in float (4.89 ms against 1.55 ms, a 64-channel 3x3 block).
    f32 Convs are left to ORT as before. onnxscript has no rule that adds a bias."""
    if node.op_type != "Conv" or len(node.input) != 2:
        return False
    dq = view.producer.get(node.input[1])
    weight = (
        view.array(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
    )
    if weight is None:
        return False
    return _with_bias(view, node, weight.shape[0], weight.ndim)


REWRITES: tuple[Rewrite, ...] = (
    _hard_sigmoid,
    _instance_norm,
    _batch_norm,
    _global_pool,
    _conv_transpose_bias,
    _int8_conv_bias,
)


def fuse_idioms(
    model: onnx.ModelProto, ranks: dict[str, int], shapes: dict[str, tuple[int, ...]] | None = None
) -> onnx.ModelProto:
    """``model`` with the chains above replaced by their fused ops (the graph is edited in place;
    the model returned may be a new one, and is the one to use).

    ``ranks`` gives the rank of each value, ``shapes`` the static shape of those the
    translator knows (InstanceNormalization needs the channel count). Partune's rewrites run
    to a fixed point first, then onnxscript's HardSwish rules: a HardSigmoid(1/6, 1/2) made by
    ours is what onnxscript's HardSwishFusionFromHardSigmoid looks for.
    """
    view = _View(model.graph, ranks, shapes)
    changed, rewrote = True, False
    while changed:
        changed = False
        for node in list(view.nodes):
            if node in view.nodes and any(rw(view, node) for rw in REWRITES):
                changed = rewrote = True
    del model.graph.node[:]
    model.graph.node.extend(view.nodes)
    if rewrote:  # constants only a replaced chain read (an absorbed scale) are dropped
        used = {i for n in view.nodes for i in n.input} | view.outputs
        live = [t for t in model.graph.initializer if t.name in used]
        if len(live) != len(model.graph.initializer):
            del model.graph.initializer[:]
            model.graph.initializer.extend(live)
    if any(
        n.op_type in ("Clip", "HardSigmoid") for n in model.graph.node
    ):  # else skip the IR round trip
        model = onnxscript.rewriter.rewrite(model, fuse_hardswish_rules())
    return model
