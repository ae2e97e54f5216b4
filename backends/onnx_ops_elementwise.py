"""Translators of elementwise Relax ops: arithmetic, comparisons, logic, activations, casts.

One ONNX node (or a short fixed chain) per Relax op, broadcasting as NumPy does. One of the
op families whose tables ``onnx_ops`` joins; kept apart so no module holds every op.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.backends.base import BackendError
from partune.backends.onnx_graph import (
    FLOATS,
    ONNX_DTYPES,
    OnnxGraph,
    Translator,
    Value,
    arg_dtype,
    norm_axis,
    op_name,
    registrar,
    scalar_value,
    tensor_dtype,
    tensor_shape,
)

TRANSLATORS: dict[str, Translator] = {}
_register = registrar(TRANSLATORS)


_UNARY: dict[str, str] = {
    "relax.nn.relu": "Relu",
    "relax.sigmoid": "Sigmoid",
    "relax.tanh": "Tanh",
    "relax.erf": "Erf",
    "relax.exp": "Exp",
    "relax.log": "Log",
    "relax.sqrt": "Sqrt",
    "relax.abs": "Abs",
    "relax.negative": "Neg",
    "relax.floor": "Floor",
    "relax.ceil": "Ceil",
    "relax.sin": "Sin",
    "relax.cos": "Cos",
    "relax.isnan": "IsNaN",
    "relax.isinf": "IsInf",
    "relax.sign": "Sign",
    "relax.round": "Round",
}
_BINARY: dict[str, str] = {
    "relax.add": "Add",
    "relax.subtract": "Sub",
    "relax.multiply": "Mul",
    "relax.divide": "Div",
    "relax.power": "Pow",
    "relax.maximum": "Max",
    "relax.minimum": "Min",
    "relax.equal": "Equal",
    "relax.less": "Less",
    "relax.less_equal": "LessOrEqual",
    "relax.greater": "Greater",
    "relax.greater_equal": "GreaterOrEqual",
}
_LOGICAL: dict[str, str] = {
    "relax.logical_and": "And",
    "relax.logical_or": "Or",
    "relax.logical_xor": "Xor",
}
_BITWISE: dict[str, str] = {
    "relax.bitwise_and": "And",
    "relax.bitwise_or": "Or",
    "relax.bitwise_xor": "Xor",
}


@_register(*_UNARY)
def _unary(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node(_UNARY[op_name(call)], [g.tensor(call.args[0])])


def _binary_as(g: OnnxGraph, call: relax.Call, op_type: str) -> str:
    """ONNX broadcasts like NumPy, as Relax does; only the dtypes need checking."""
    if arg_dtype(call, 0) != arg_dtype(call, 1):
        raise BackendError("binary op on mixed dtypes")
    return g.node(op_type, [g.tensor(x) for x in call.args])


@_register(*_BINARY)
def _binary(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _binary_as(g, call, _BINARY[op_name(call)])


@_register("relax.not_equal")
def _not_equal(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """IEEE: NaN != NaN is true (TVM's LLVM lowering says false; torch and NumPy say true)."""
    return g.node("Not", [_binary_as(g, call, "Equal")])


def _as_bool(g: OnnxGraph, call: relax.Call, i: int) -> str:
    """Logical ops take truth values: nonzero is true, as in TVM's lowering."""
    return g.cast(g.tensor(call.args[i]), arg_dtype(call, i), "bool")


@_register(*_LOGICAL)
def _logical(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node(_LOGICAL[op_name(call)], [_as_bool(g, call, 0), _as_bool(g, call, 1)])


@_register("relax.logical_not")
def _logical_not(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Not", [_as_bool(g, call, 0)])


@_register(*_BITWISE)
def _bitwise(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    dtypes = {arg_dtype(call, 0), arg_dtype(call, 1)}
    if dtypes == {"bool"}:  # bitwise on bool is logical (torch's `&` on masks)
        return g.node(_BITWISE[op_name(call)], [g.tensor(x) for x in call.args])
    if g.opset < 18 or len(dtypes) != 1 or dtypes & FLOATS:
        raise BackendError("integer bitwise ops need opset 18 and one integer dtype")
    return g.node("Bitwise" + _BITWISE[op_name(call)], [g.tensor(x) for x in call.args])


@_register("relax.rsqrt")
def _rsqrt(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Reciprocal", [g.node("Sqrt", [g.tensor(call.args[0])])])


@_register("relax.nn.silu")
def _silu(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    x = g.tensor(call.args[0])
    return g.node("Mul", [x, g.node("Sigmoid", [x])])


@_register("relax.nn.gelu")
def _gelu(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """0.5 x (1 + erf(x / sqrt 2)), in the exact form ORT's GeluFusion matches."""
    dtype = tensor_dtype(ty)
    x = g.tensor(call.args[0])
    erf = g.node("Erf", [g.node("Div", [x, g.scalar(np.sqrt(2.0), dtype)])])
    one_plus = g.node("Add", [erf, g.scalar(1.0, dtype)])
    return g.node("Mul", [g.node("Mul", [x, one_plus]), g.scalar(0.5, dtype)])


@_register("relax.nn.gelu_tanh")
def _gelu_tanh(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the form ORT's FastGelu fusion matches."""
    dtype = tensor_dtype(ty)
    x = g.tensor(call.args[0])
    cube = g.node("Pow", [x, g.scalar(3.0, dtype)])
    inner = g.node("Add", [x, g.node("Mul", [cube, g.scalar(0.044715, dtype)])])
    th = g.node("Tanh", [g.node("Mul", [inner, g.scalar(np.sqrt(2.0 / np.pi), dtype)])])
    half_x = g.node("Mul", [x, g.scalar(0.5, dtype)])
    return g.node("Mul", [half_x, g.node("Add", [th, g.scalar(1.0, dtype)])])


@_register("relax.nn.leakyrelu")
def _leakyrelu(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("LeakyRelu", [g.tensor(call.args[0])], alpha=float(call.attrs.alpha))


@_register("relax.clip")
def _clip(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    dtype = tensor_dtype(ty)
    lo, hi = scalar_value(call.args[1]), scalar_value(call.args[2])
    if lo > hi:  # TVM gives lo there, ORT gives hi
        raise BackendError("clip with min > max")
    if dtype not in FLOATS and not (np.isfinite(lo) and np.isfinite(hi)):
        raise BackendError("integer clip with infinite bounds")
    x = g.tensor(call.args[0])
    return g.node("Clip", [x, g.scalar(lo, dtype), g.scalar(hi, dtype)])


@_register("relax.astype")
def _astype(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Cast", [g.tensor(call.args[0])], to=ONNX_DTYPES[tensor_dtype(ty)])


@_register("relax.where")
def _where(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    if arg_dtype(call, 1) != arg_dtype(call, 2):
        raise BackendError("where on mixed dtypes")
    return g.node("Where", [_as_bool(g, call, 0), g.tensor(call.args[1]), g.tensor(call.args[2])])


@_register("relax.quantize", "relax.dequantize")
def _quantize(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """QuantizeLinear / DequantizeLinear: the QDQ form onnxruntime and OpenVINO run in int8
    (``partune.core.int8``); a per-channel scale carries its axis, a scalar one none."""
    data, scale, zero = (g.tensor(a) for a in call.args)
    per_channel = len(tensor_shape(call.args[1].ty)) > 0
    axis = {"axis": norm_axis(int(call.attrs.axis), len(tensor_shape(call.args[0].ty)))}
    op = "QuantizeLinear" if op_name(call) == "relax.quantize" else "DequantizeLinear"
    return g.node(op, [data, scale, zero], **(axis if per_channel else {}))
