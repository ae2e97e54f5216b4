"""The peephole fuser: finds chains of bindings in a region that one ATen call can run
(conv2d or linear with what they absorb, the exported ``_safe_softmax``).

It only plans: which bindings form a chain and what the anchor absorbs. Separate from
the translators, which see one binding at a time, and from the program, which turns the
plan and the remaining bindings into steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from tvm.relax import dpl

from partune.backends.torch_op_registry import (
    FLOATS,
    GenericConst,
    Unsupported,
    ints,
    norm_axis,
    static_value,
    tensor_type,
)
from partune.backends.torch_ops import translate_call

# --------------------------------------------------------------------------- peepholes

Activation = Callable[[torch.Tensor], torch.Tensor]


def clip_inplace(call: relax.Call) -> Activation:
    lo, hi = static_value(call.args[1]), static_value(call.args[2])
    return lambda y: y.clamp_(lo, hi)


ACTIVATIONS: dict[str, Callable[[relax.Call], Activation]] = {
    "relax.nn.relu": lambda c: torch.relu_,
    "relax.nn.silu": lambda c: lambda y: F.silu(y, inplace=True),
    "relax.nn.gelu": lambda c: F.gelu,
    "relax.nn.gelu_tanh": lambda c: lambda y: F.gelu(y, approximate="tanh"),
    "relax.sigmoid": lambda c: torch.sigmoid_,
    "relax.tanh": lambda c: torch.tanh_,
    "relax.clip": clip_inplace,
}


@dataclass
class Chain:
    """An anchor op plus what it absorbed.

    ``folds`` are per-channel affine maps on the anchor's output, folded into its weight
    and bias at build time: ("bias", constant), ("mul", constant), ("bn", batch_norm call).
    ``post`` runs after the anchor, in place where it can: ("reshape", shape),
    ("add", variable), ("act", function).
    """

    members: list[int]
    weight: Any = None
    folds: list[tuple[str, Any]] = field(default_factory=list)
    post: list[tuple[str, Any]] = field(default_factory=list)
    pad: tuple[int, int, int, int] | None = None  # a zero pad absorbed before a convolution
    data: Any = None  # the anchor's input, where the emitter cannot read it off a member
    axis: int = -1


@dataclass
class Graph:
    """The bindings of a region with their users, for the peephole matcher."""

    bindings: list[relax.VarBinding]
    producer: dict[relax.Var, int] = field(default_factory=dict)
    users: dict[relax.Var, list[int]] = field(default_factory=dict)
    outputs: set[relax.Var] = field(default_factory=set)
    constant: set[relax.Var] = field(default_factory=set)  # known at build time

    def sole_user(self, var: relax.Var) -> int | None:
        """The one binding reading ``var``, when nothing else (and no output) does."""
        users = self.users.get(var, [])
        if var in self.outputs or len(users) != 1:
            return None
        return users[0]

    def call(self, i: int, name: str) -> relax.Call | None:
        v = self.bindings[i].value
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == name:
            return v
        return None

    def is_const(self, e: Any) -> bool:
        return isinstance(e, GenericConst) or (isinstance(e, relax.Var) and e in self.constant)


def collect_vars(e: Any, out: list[relax.Var]) -> None:
    if isinstance(e, relax.Var):
        out.append(e)
    elif isinstance(e, relax.Tuple):
        for f in e.fields:
            collect_vars(f, out)
    elif isinstance(e, relax.Call):
        for a in e.args:
            collect_vars(a, out)
    elif isinstance(e, relax.TupleGetItem):
        collect_vars(e.tuple_value, out)


def make_graph(bindings: list[relax.VarBinding], ret: Any) -> Graph:
    g = Graph(bindings)
    for i, b in enumerate(bindings):
        g.producer[b.var] = i
        used: list[relax.Var] = []
        collect_vars(b.value, used)
        for v in used:
            g.users.setdefault(v, []).append(i)
        if all(v in g.constant for v in used):
            g.constant.add(b.var)
    outs: list[relax.Var] = []
    collect_vars(ret, outs)
    g.outputs = set(outs)
    return g


def per_channel(g: Graph, e: Any, shape: tuple[int, ...], dtype: str, axis: int) -> bool:
    """Whether ``e`` is a constant that broadcasts against ``shape`` along ``axis`` only."""
    if not g.is_const(e):
        return False
    try:
        cshape, cdtype = tensor_type(e.ty)
    except Unsupported:
        return False
    if cdtype != dtype or len(cshape) > len(shape):
        return False
    full = (1,) * (len(shape) - len(cshape)) + cshape
    return all(d == 1 for i, d in enumerate(full) if i != axis) and full[axis] in (1, shape[axis])


def other_arg(call: relax.Call, var: relax.Var) -> Any:
    a, b = call.args[0], call.args[1]
    return b if a.same_as(var) else a


def bn_foldable(g: Graph, i: int, var: relax.Var, shape: tuple[int, ...], dtype: str) -> bool:
    """Whether binding ``i`` is an inference batch norm of ``var`` with constant parameters."""
    call = g.call(i, "relax.nn.batch_norm")
    if call is None or not call.args[0].same_as(var) or bool(call.attrs.training):
        return False
    if len(shape) < 2 or norm_axis(int(call.attrs.axis), len(shape)) != 1:
        return False
    return all(per_channel(g, a, (shape[1],), dtype, 0) for a in call.args[1:])


def item0_user(g: Graph, i: int) -> int | None:
    """The binding that takes item 0 of binding ``i``'s tuple, when it is the only reader."""
    tgi = g.sole_user(g.bindings[i].var)
    if tgi is None:
        return None
    item = g.bindings[tgi].value
    return tgi if isinstance(item, relax.TupleGetItem) and int(item.index) == 0 else None


def can_fold(chain: Chain, linear: bool, shape: tuple[int, ...], channels: int) -> bool:
    """Folds need the anchor's raw output: nothing after it but (for linear) reshapes
    that keep the feature axis last."""
    if not linear:
        return not chain.post
    return all(k == "reshape" for k, _ in chain.post) and shape[-1] == channels


def absorb(
    g: Graph, chain: Chain, i: int, var: relax.Var, linear: bool, channels: int
) -> int | None:
    """Add binding ``i`` (the sole user of ``var``) to the chain; its last binding, or None."""
    value, out_ty = g.bindings[i].value, g.bindings[i].var.ty
    shape, dtype = tensor_type(var.ty)
    axis = len(shape) - 1 if linear else 1
    foldable = can_fold(chain, linear, shape, channels)
    name = (
        value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""
    )
    if name in ("relax.add", "relax.multiply"):
        if tensor_type(out_ty) != (shape, dtype):
            return None
        other = other_arg(value, var)
        if foldable and per_channel(g, other, shape, dtype, axis):
            chain.folds.append(("bias" if name == "relax.add" else "mul", other))
            return i
        if (
            name == "relax.add"
            and isinstance(other, relax.Var)
            and not other.same_as(var)
            and tensor_type(other.ty) == (shape, dtype)
        ):
            chain.post.append(("add", other))
            return i
        return None
    if name == "relax.nn.batch_norm" and not linear and foldable:
        if not bn_foldable(g, i, var, shape, dtype):
            return None
        chain.folds.append(("bn", value))
        tgi = item0_user(g, i)
        if tgi is not None:
            chain.members.append(i)
            return tgi
        chain.post.append(("bn_tuple", value))  # the tuple itself is read: (y, mean, var)
        return i
    if name in RESHAPES:
        chain.post.append(("reshape", tensor_type(out_ty)[0]))
        return i
    if name in ACTIVATIONS and value.args[0].same_as(var):
        translate_call(value, out_ty, torch.device("cpu"))
        chain.post.append(("act", ACTIVATIONS[name](value)))
        return i
    return None


def grow_chain(g: Graph, chain: Chain, linear: bool, channels: int) -> relax.Var:
    """Absorb consumers of the anchor while each is the sole user of the previous result."""
    var = g.bindings[chain.members[-1]].var
    while (nxt := g.sole_user(var)) is not None:
        try:
            last = absorb(g, chain, nxt, var, linear, channels)
        except Unsupported:
            last = None
        if last is None:
            break
        chain.members.append(last)
        var = g.bindings[last].var
    # A trailing view is not worth fusing: leave it to its own (alias-cheap) step.
    while (
        chain.post
        and chain.post[-1][0] == "reshape"
        and is_view(g.bindings[chain.members[-1]].value)
    ):
        chain.post.pop()
        chain.members.pop()
        var = g.bindings[chain.members[-1]].var
    return var


RESHAPES = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")


def is_view(value: Any) -> bool:
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name in RESHAPES
    )


def absorb_pad(g: Graph, data: Any) -> tuple[int, tuple[int, int, int, int]] | None:
    """A zero pad of H and W feeding only this convolution: (its binding, top/left/bottom/right)."""
    if not isinstance(data, relax.Var) or data not in g.producer:
        return None
    i = g.producer[data]
    call = g.call(i, "relax.nn.pad")
    if call is None or g.sole_user(data) is None or len(call.args) != 1:
        return None
    w = ints(call.attrs.pad_width)
    if str(call.attrs.pad_mode) != "constant" or float(call.attrs.pad_value) != 0.0 or len(w) != 8:
        return None
    if any(w[:4]) or any(v < 0 for v in w):
        return None
    return i, (w[4], w[6], w[5], w[7])


Match = tuple[Chain, relax.Var]


def match_conv(g: Graph, i: int) -> Match | None:
    """conv2d with a constant weight, plus pad before and bias/BN/residual/activation after."""
    call = g.call(i, "relax.nn.conv2d")
    if call is None or not g.is_const(call.args[1]):
        return None
    translate_call(call, g.bindings[i].var.ty, torch.device("cpu"))  # attribute checks
    chain = Chain([i], weight=call.args[1])
    pad = absorb_pad(g, call.args[0])
    if pad is not None:
        chain.members.insert(0, pad[0])
        chain.pad = pad[1]
    channels = tensor_type(g.bindings[i].var.ty)[0][1]
    last = grow_chain(g, chain, linear=False, channels=channels)
    return (chain, last) if len(chain.members) > 1 else None


def match_linear(g: Graph, i: int) -> Match | None:
    """matmul(x, W) with a constant 2-d W: F.linear, with bias (addmm), residual, activation."""
    call = g.call(i, "relax.matmul")
    if call is None or not g.is_const(call.args[1]):
        return None
    translate_call(call, g.bindings[i].var.ty, torch.device("cpu"))
    shape, dtype = tensor_type(g.bindings[i].var.ty)
    if len(tensor_type(call.args[1].ty)[0]) != 2 or tensor_type(call.args[0].ty)[1] != dtype:
        return None
    chain = Chain([i], weight=call.args[1])
    return chain, grow_chain(g, chain, linear=True, channels=shape[-1])


def is_scalar_const(e: Any, value: float) -> bool:
    if not isinstance(e, GenericConst) or e.value.numpy().size != 1:
        return False
    v = float(e.value.numpy().reshape(-1)[0])
    return v == value or (v != v and value != value)


def _safe_softmax_pattern() -> tuple[dict[str, dpl.DFPattern], dpl.DFPattern]:
    """``where(not(bool(max(int8(not(a == c0))))), full_like(softmax(a), c1), softmax(a))``: the
    nine bindings of torch's exported ``_safe_softmax``, by name, and the pattern (rooted at the
    where). The constants' values and the max's axis are checked after the match."""
    a = dpl.wildcard()
    p = {
        "softmax": dpl.is_op("relax.nn.softmax")(a),
        "equal": dpl.is_op("relax.equal")(a, dpl.is_const()),
    }
    p["not"] = dpl.is_op("relax.logical_not")(p["equal"])
    p["int8"] = dpl.is_op("relax.astype")(p["not"])
    p["max"] = dpl.is_op("relax.max")(p["int8"])
    p["bool"] = dpl.is_op("relax.astype")(p["max"])
    p["masked"] = dpl.is_op("relax.logical_not")(p["bool"])
    p["fill"] = dpl.is_op("relax.full_like")(p["softmax"], dpl.is_const())
    p["where"] = dpl.is_op("relax.where")(p["masked"], p["fill"], p["softmax"])
    return p, p["where"]


SAFE_SOFTMAX = _safe_softmax_pattern()


def match_safe_softmax(g: Graph, i: int) -> Match | None:
    """torch's ``_safe_softmax`` as exported: softmax, zeroed on rows that are all -inf.

    The nine bindings (``SAFE_SOFTMAX``, matched with DPL from the where at ``i``) become
    softmax plus one in-place masked fill, where no value inside is read from outside.
    """
    if g.call(i, "relax.where") is None:
        return None
    parts, root = SAFE_SOFTMAX
    var2val = {b.var: b.value for b in g.bindings}
    found = root.extract_matched_expr(g.bindings[i].value, var2val)
    if found is None:
        return None
    at = {b.value: j for j, b in enumerate(g.bindings)}
    members = [at.get(found[p]) for p in parts.values()]
    if None in members:
        return None
    sm, eq, mx, fill = (found[parts[k]] for k in ("softmax", "equal", "max", "fill"))
    a = sm.args[0]
    shape, dtype = tensor_type(a.ty)
    axis = norm_axis(int(sm.attrs.axis), len(shape))
    if (
        dtype not in FLOATS
        or not is_scalar_const(eq.args[1], float("-inf"))
        or not is_scalar_const(fill.args[1], 0.0)
        or mx.attrs.axis is None
        or not bool(mx.attrs.keepdims)
        or [norm_axis(int(x), len(shape)) for x in mx.attrs.axis] != [axis]
    ):
        return None
    inside = set(members)
    for j in members[:-1]:  # every value but the result is read only inside, and not returned
        var = g.bindings[j].var
        if var in g.outputs or not set(g.users.get(var, [])) <= inside:
            return None
    return Chain(sorted(members), data=a, axis=axis), g.bindings[i].var


MATCHERS: tuple[tuple[str, Callable[[Graph, int], Match | None]], ...] = (
    ("conv", match_conv),
    ("linear", match_linear),
    ("safe_softmax", match_safe_softmax),
)


def plan_chains(g: Graph) -> tuple[dict[int, tuple[str, Chain, relax.Var]], set[int]]:
    """Find peephole chains: each is emitted at its last member, the others are skipped."""
    at: dict[int, tuple[str, Chain, relax.Var]] = {}
    taken: set[int] = set()
    for i in range(len(g.bindings)):
        if i in taken or g.bindings[i].var in g.constant:
            continue  # constant sub-expressions are folded one op at a time anyway
        for kind, match in MATCHERS:
            try:
                found = match(g, i)
            except Unsupported:
                found = None
            if found is None or any(m in taken for m in found[0].members):
                continue
            chain, last = found
            taken.update(chain.members)
            at[g.producer[last]] = (kind, chain, last)
            break
    return at, taken
