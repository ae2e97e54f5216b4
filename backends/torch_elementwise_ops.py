"""Translators for the element-wise Relax ops: arithmetic, comparisons, logic, unary
maths, ``clip``, ``where`` and ``astype``.

One family of the op translators (see ``torch_ops``), kept apart from the nn, reduction
and shape families so each module stays about one kind of op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from partune.backends.torch_op_registry import (
    FLOATS,
    INTS,
    NUMERIC,
    TORCH_DTYPES,
    OpCall,
    OpFn,
    identity,
    op,
)

# --------------------------------------------------------------------------- element-wise

ARITH = {
    "relax.add": torch.add,
    "relax.subtract": torch.sub,
    "relax.multiply": torch.mul,
    "relax.maximum": torch.maximum,
    "relax.minimum": torch.minimum,
}
COMPARE = {
    "relax.equal": torch.eq,
    "relax.not_equal": torch.ne,
    "relax.less": torch.lt,
    "relax.less_equal": torch.le,
    "relax.greater": torch.gt,
    "relax.greater_equal": torch.ge,
}
LOGICAL = {
    "relax.logical_and": torch.logical_and,
    "relax.logical_or": torch.logical_or,
    "relax.logical_xor": torch.logical_xor,
}
BITWISE = {
    "relax.bitwise_and": torch.bitwise_and,
    "relax.bitwise_or": torch.bitwise_or,
    "relax.bitwise_xor": torch.bitwise_xor,
}
FLOAT_UNARY = {
    "relax.exp": torch.exp,
    "relax.log": torch.log,
    "relax.erf": torch.erf,
    "relax.sqrt": torch.sqrt,
    "relax.rsqrt": torch.rsqrt,
    "relax.sigmoid": torch.sigmoid,
    "relax.tanh": torch.tanh,
    "relax.sin": torch.sin,
    "relax.cos": torch.cos,
    "relax.floor": torch.floor,
    "relax.ceil": torch.ceil,
    "relax.nn.relu": torch.relu,
    "relax.nn.silu": F.silu,
    "relax.nn.gelu": F.gelu,
    "relax.nn.gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
NUMERIC_UNARY = {"relax.abs": torch.abs, "relax.negative": torch.neg}


@op(*ARITH)
def tr_arith(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC)
    return ARITH[o.call.op.name]


@op(*COMPARE)
def tr_compare(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC | {"bool"})
    return COMPARE[o.call.op.name]


@op(*LOGICAL)
def tr_logical(o: OpCall) -> OpFn:
    o.dtypes_in(frozenset({"bool"}))
    return LOGICAL[o.call.op.name]


@op(*BITWISE)
def tr_bitwise(o: OpCall) -> OpFn:
    o.dtypes_in(INTS | {"bool"})
    return BITWISE[o.call.op.name]


@op("relax.logical_not")
def tr_logical_not(o: OpCall) -> OpFn:
    o.dtypes_in(frozenset({"bool"}))
    return torch.logical_not


@op(*FLOAT_UNARY)
def tr_float_unary(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    return FLOAT_UNARY[o.call.op.name]


@op(*NUMERIC_UNARY)
def tr_numeric_unary(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC)
    return NUMERIC_UNARY[o.call.op.name]


@op("relax.divide")
def tr_divide(o: OpCall) -> OpFn:
    """TVM divides integers with truncation (C semantics); torch would return floats."""
    o.dtypes_in(NUMERIC)
    if o.arg(0)[1] in INTS:
        return lambda a, b: torch.div(a, b, rounding_mode="trunc")
    return torch.div


@op("relax.floor_divide")
def tr_floor_divide(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC)
    return torch.floor_divide


@op("relax.floor_mod")
def tr_floor_mod(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC)
    return torch.remainder


@op("relax.power")
def tr_power(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    return torch.pow


@op("relax.clip")
def tr_clip(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC, 0)
    lo, hi = o.static(1), o.static(2)
    if o.arg(0)[1] in INTS:  # keep the integer dtype: torch would promote on float bounds
        lo, hi = int(lo), int(hi)
    return lambda x: torch.clamp(x, lo, hi)


@op("relax.where")
def tr_where(o: OpCall) -> OpFn:
    o.need(o.arg(0)[1] == "bool", "condition must be bool")
    o.dtypes_in(NUMERIC | {"bool"}, 1, 2)
    return torch.where


@op("relax.astype")
def tr_astype(o: OpCall) -> OpFn:
    o.arg(0)
    dtype = o.out_dtype
    if dtype == TORCH_DTYPES[o.arg(0)[1]]:
        return identity
    return lambda x: x.to(dtype)
