"""ONNX Runtime backend: a region becomes one ONNX graph run by one InferenceSession.

Translating a whole region into one graph (rather than calling ORT op by op) lets ORT's
own graph optimisations apply: constant folding, Conv+BN+Add+activation fusion, GELU and
LayerNorm fusion, NCHWc layout transformation. The translation is a pure function of the
Relax function (``relax_to_onnx``); every emitted value is checked against the Relax type
by ONNX strict shape inference, so a translator that gets a shape or dtype wrong fails
loudly at build time instead of computing garbage.

``accepts`` never guesses: it translates the single binding into a one-node graph and
creates an ORT session for it (cached per op signature), so an attribute, layout or dtype
ORT has no kernel for is refused, not discovered later.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from partune.backends import build_cache
from partune.backends.base import Backend, BackendError, FusionStyle, Level
from partune.backends.kernel import BoundKernel, Spec
from partune.backends.onnx_idioms import fuse_idioms

if TYPE_CHECKING:
    from partune.core.scopes import SEScope

MIN_OPSET = 17  # LayerNormalization
Value = Any  # an ONNX tensor name (str), or a list of Values for a Relax tuple
Translator = Callable[["_Graph", relax.Call, tvm.ir.Type], Value]

_ONNX_DTYPES: dict[str, int] = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "float64": TensorProto.DOUBLE,
    "int8": TensorProto.INT8,
    "int16": TensorProto.INT16,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "uint8": TensorProto.UINT8,
    "uint16": TensorProto.UINT16,
    "uint32": TensorProto.UINT32,
    "uint64": TensorProto.UINT64,
    "bool": TensorProto.BOOL,
}
_FLOATS = frozenset({"float16", "float32", "float64"})


# ---------------------------------------------------------------------------------------
# Relax type helpers


def _dtype(ty: tvm.ir.Type) -> str:
    """The element dtype of a tensor type, refusing what ONNX cannot hold."""
    if not isinstance(ty, relax.TensorType):
        raise BackendError(f"expected a tensor, got {ty}")
    dtype = str(ty.dtype)
    if dtype not in _ONNX_DTYPES:
        raise BackendError(f"dtype {dtype} not supported")
    return dtype


def _shape(ty: tvm.ir.Type) -> tuple[int, ...]:
    """The static shape of a tensor type (every region the search builds is static)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise BackendError(f"expected a tensor of known shape, got {ty}")
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        raise BackendError(f"dynamic shape {ty.shape} not supported")
    return tuple(int(d) for d in dims)


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values]


def _scalar(expr: Any) -> int | float:
    """The Python value of a constant primitive argument (IntImm / FloatImm)."""
    if isinstance(expr, tvm.tirx.IntImm | tvm.tirx.FloatImm):
        return expr.value
    raise BackendError(f"expected a constant scalar, got {expr}")


def _const_ints(expr: Any) -> list[int]:
    """A tuple of constant integers (a relax.Tuple of IntImm, or a static ShapeExpr)."""
    items = expr.values if isinstance(expr, relax.ShapeExpr) else expr.fields
    return [int(_scalar(v)) for v in items]


def _flat_types(ty: tvm.ir.Type) -> list[tvm.ir.Type]:
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in _flat_types(f)]
    return [ty]


def _flatten(value: Value) -> list[str]:
    if isinstance(value, list):
        return [n for v in value for n in _flatten(v)]
    return [value]


def _is_tensor_const(expr: Any) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.ty, relax.TensorType)


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise BackendError(f"axis {axis} out of range for rank {ndim}")
    return axis % ndim if ndim else 0


# ---------------------------------------------------------------------------------------
# Graph builder


class _Graph:
    """An ONNX graph under construction: nodes, initializers and the Relax -> ONNX names."""

    def __init__(self, opset: int, placeholder_above: int | None = None) -> None:
        self.opset = opset
        # accepts() dry runs make big constants graph inputs instead of copying weights.
        self.placeholder_above = placeholder_above
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.env: dict[Any, Value] = {}
        self.expected: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.hint = "t"
        self._used: set[str] = set()
        self._consts: dict[Any, str] = {}
        self._small: dict[tuple, str] = {}

    def fresh(self, hint: str | None = None) -> str:
        base = hint or self.hint
        name, i = base, 0
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name

    def node(self, op_type: str, inputs: Sequence[str], outputs: int = 1, **attrs: Any) -> Any:
        """Append one node; returns its output name (or names when ``outputs`` > 1)."""
        names = [self.fresh() for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def add_input(self, name: str, ty: tvm.ir.Type) -> str:
        name = self.fresh(name)
        self.inputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPES[_dtype(ty)], _shape(ty)))
        return name

    def array(self, arr: np.ndarray) -> str:
        """An initializer; small ones (scalars, shapes) are shared."""
        key = None
        if arr.size <= 16:
            key = (arr.dtype.str, arr.shape, arr.tobytes())
            if key in self._small:
                return self._small[key]
        name = self.fresh("c")
        self.initializers.append(numpy_helper.from_array(arr, name))
        if key is not None:
            self._small[key] = name
        return name

    def scalar(self, value: int | float | bool, dtype: str) -> str:
        return self.array(np.array(value, dtype=dtype))

    def int64s(self, values: Sequence[int]) -> str:
        return self.array(np.asarray(values, dtype=np.int64).reshape(len(values)))

    def const(self, expr: Any) -> str:
        """A Relax tensor constant: an initializer (or a placeholder input in a dry run)."""
        if expr in self._consts:  # Relax objects hash by handle: one initializer per constant
            return self._consts[expr]
        ty = expr.ty
        dtype = _dtype(ty)
        size = int(np.prod(_shape(ty)))
        if self.placeholder_above is not None and size > self.placeholder_above:
            name = self.add_input("w", ty)
        else:
            arr = expr.value.numpy()
            if str(arr.dtype) != dtype:
                raise BackendError(f"constant of dtype {arr.dtype}, type says {dtype}")
            name = self.array(arr)
        self._consts[expr] = name
        return name

    def value(self, expr: Any) -> Value:
        """The ONNX name(s) of a Relax argument expression."""
        if isinstance(expr, relax.Var):
            if expr not in self.env:
                raise BackendError(f"free variable {expr.name}")
            return self.env[expr]
        if _is_tensor_const(expr):
            return self.const(expr)
        if isinstance(expr, relax.Tuple):
            return [self.value(f) for f in expr.fields]
        if isinstance(expr, relax.TupleGetItem):
            tup = self.value(expr.tuple_value)
            if not isinstance(tup, list):
                raise BackendError("TupleGetItem of a non-tuple")
            return tup[int(expr.index)]
        raise BackendError(f"unsupported argument {type(expr).__name__}")

    def tensor(self, expr: Any) -> str:
        val = self.value(expr)
        if isinstance(val, list):
            raise BackendError("expected a tensor, got a tuple")
        return val

    def cast(self, name: str, src: str, dst: str) -> str:
        return name if src == dst else self.node("Cast", [name], to=_ONNX_DTYPES[dst])

    def reshape(self, name: str, shape: Sequence[int]) -> str:
        return self.node("Reshape", [name, self.int64s(shape)])

    def bind(self, var: relax.Var, value: Value) -> None:
        """Record a binding and the type ONNX shape inference must agree with."""
        names, types = _flatten(value), _flat_types(var.ty)
        if len(names) != len(types):
            raise BackendError(f"{var.name}: {len(names)} values for type {var.ty}")
        self.env[var] = value
        for name, ty in zip(names, types, strict=True):
            self.expected.setdefault(name, (_dtype(ty), _shape(ty)))


# ---------------------------------------------------------------------------------------
# Translators: one function per Relax op, registered in _TRANSLATORS


_TRANSLATORS: dict[str, Translator] = {}


def _register(*names: str) -> Callable[[Translator], Translator]:
    def deco(fn: Translator) -> Translator:
        for n in names:
            _TRANSLATORS[n] = fn
        return fn

    return deco


def _arg_dtype(call: relax.Call, i: int) -> str:
    return _dtype(call.args[i].ty)


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


def _op_name(call: relax.Call) -> str:
    return call.op.name


@_register(*_UNARY)
def _unary(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node(_UNARY[_op_name(call)], [g.tensor(call.args[0])])


def _binary_as(g: _Graph, call: relax.Call, op_type: str) -> str:
    """ONNX broadcasts like NumPy, as Relax does; only the dtypes need checking."""
    if _arg_dtype(call, 0) != _arg_dtype(call, 1):
        raise BackendError("binary op on mixed dtypes")
    return g.node(op_type, [g.tensor(x) for x in call.args])


@_register(*_BINARY)
def _binary(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _binary_as(g, call, _BINARY[_op_name(call)])


@_register("relax.not_equal")
def _not_equal(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """IEEE: NaN != NaN is true (TVM's LLVM lowering says false; torch and NumPy say true)."""
    return g.node("Not", [_binary_as(g, call, "Equal")])


def _as_bool(g: _Graph, call: relax.Call, i: int) -> str:
    """Logical ops take truth values: nonzero is true, as in TVM's lowering."""
    return g.cast(g.tensor(call.args[i]), _arg_dtype(call, i), "bool")


@_register(*_LOGICAL)
def _logical(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node(_LOGICAL[_op_name(call)], [_as_bool(g, call, 0), _as_bool(g, call, 1)])


@_register("relax.logical_not")
def _logical_not(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Not", [_as_bool(g, call, 0)])


@_register(*_BITWISE)
def _bitwise(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    dtypes = {_arg_dtype(call, 0), _arg_dtype(call, 1)}
    if dtypes == {"bool"}:  # bitwise on bool is logical (torch's `&` on masks)
        return g.node(_BITWISE[_op_name(call)], [g.tensor(x) for x in call.args])
    if g.opset < 18 or len(dtypes) != 1 or dtypes & _FLOATS:
        raise BackendError("integer bitwise ops need opset 18 and one integer dtype")
    return g.node("Bitwise" + _BITWISE[_op_name(call)], [g.tensor(x) for x in call.args])


@_register("relax.rsqrt")
def _rsqrt(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Reciprocal", [g.node("Sqrt", [g.tensor(call.args[0])])])


@_register("relax.nn.silu")
def _silu(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    x = g.tensor(call.args[0])
    return g.node("Mul", [x, g.node("Sigmoid", [x])])


@_register("relax.nn.gelu")
def _gelu(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """0.5 x (1 + erf(x / sqrt 2)), in the exact form ORT's GeluFusion matches."""
    dtype = _dtype(ty)
    x = g.tensor(call.args[0])
    erf = g.node("Erf", [g.node("Div", [x, g.scalar(np.sqrt(2.0), dtype)])])
    one_plus = g.node("Add", [erf, g.scalar(1.0, dtype)])
    return g.node("Mul", [g.node("Mul", [x, one_plus]), g.scalar(0.5, dtype)])


@_register("relax.nn.gelu_tanh")
def _gelu_tanh(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the form ORT's FastGelu fusion matches."""
    dtype = _dtype(ty)
    x = g.tensor(call.args[0])
    cube = g.node("Pow", [x, g.scalar(3.0, dtype)])
    inner = g.node("Add", [x, g.node("Mul", [cube, g.scalar(0.044715, dtype)])])
    th = g.node("Tanh", [g.node("Mul", [inner, g.scalar(np.sqrt(2.0 / np.pi), dtype)])])
    half_x = g.node("Mul", [x, g.scalar(0.5, dtype)])
    return g.node("Mul", [half_x, g.node("Add", [th, g.scalar(1.0, dtype)])])


@_register("relax.nn.leakyrelu")
def _leakyrelu(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("LeakyRelu", [g.tensor(call.args[0])], alpha=float(call.attrs.alpha))


@_register("relax.nn.softmax", "relax.nn.log_softmax")
def _softmax(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    op = "Softmax" if _op_name(call) == "relax.nn.softmax" else "LogSoftmax"
    return g.node(op, [g.tensor(call.args[0])], axis=int(call.attrs.axis))


@_register("relax.clip")
def _clip(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    dtype = _dtype(ty)
    lo, hi = _scalar(call.args[1]), _scalar(call.args[2])
    if lo > hi:  # TVM gives lo there, ORT gives hi
        raise BackendError("clip with min > max")
    if dtype not in _FLOATS and not (np.isfinite(lo) and np.isfinite(hi)):
        raise BackendError("integer clip with infinite bounds")
    x = g.tensor(call.args[0])
    return g.node("Clip", [x, g.scalar(lo, dtype), g.scalar(hi, dtype)])


@_register("relax.matmul")
def _matmul(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    out = _dtype(ty)
    a = g.cast(g.tensor(call.args[0]), _arg_dtype(call, 0), out)
    b = g.cast(g.tensor(call.args[1]), _arg_dtype(call, 1), out)
    return g.node("MatMul", [a, b])


def _check_layouts(attrs: Any, want: dict[str, str]) -> None:
    for field, layout in want.items():
        got = str(getattr(attrs, field))
        if got not in (layout, ""):
            raise BackendError(f"{field} {got} not supported (only {layout})")


# Relax convolution op -> (data layout, kernel layout) ONNX Conv / ConvTranspose compute.
_CONV_LAYOUTS: dict[str, tuple[str, str]] = {
    "relax.nn.conv1d": ("NCW", "OIW"),
    "relax.nn.conv2d": ("NCHW", "OIHW"),
    "relax.nn.conv3d": ("NCDHW", "OIDHW"),
}
_CONV_TRANSPOSE_LAYOUTS: dict[str, tuple[str, str]] = {
    "relax.nn.conv1d_transpose": ("NCW", "IOW"),
    "relax.nn.conv2d_transpose": ("NCHW", "IOHW"),
}


def _conv_operands(g: _Graph, call: relax.Call, ty: tvm.ir.Type,
                   layouts: tuple[str, str]) -> tuple[list[str], dict[str, Any]]:
    """Checked layouts; (data, weight) cast to the output dtype; the attributes Conv and
    ConvTranspose share. Relax pads are (begins..., ends...), as ONNX ``pads`` are."""
    a = call.attrs
    data, kernel = layouts
    _check_layouts(a, {"data_layout": data, "kernel_layout": kernel, "out_layout": data})
    out = _dtype(ty)
    x = g.cast(g.tensor(call.args[0]), _arg_dtype(call, 0), out)
    w = g.cast(g.tensor(call.args[1]), _arg_dtype(call, 1), out)
    attrs = {"kernel_shape": list(_shape(call.args[1].ty)[2:]), "strides": _ints(a.strides),
             "pads": _ints(a.padding), "dilations": _ints(a.dilation), "group": int(a.groups)}
    return [x, w], attrs


@_register(*_CONV_LAYOUTS)
def _conv(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """conv1d/2d/3d as one Conv node: a graph runtime's conv kernels and Conv+activation
    fusions see the op itself (an untranslated conv1d would run on the fallback backend)."""
    inputs, attrs = _conv_operands(g, call, ty, _CONV_LAYOUTS[_op_name(call)])
    return g.node("Conv", inputs, **attrs)


@_register(*_CONV_TRANSPOSE_LAYOUTS)
def _conv_transpose(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Transposed convolution; the same output size formula as ONNX with explicit pads and
    output_padding (strict shape inference checks it against the Relax type)."""
    inputs, attrs = _conv_operands(g, call, ty, _CONV_TRANSPOSE_LAYOUTS[_op_name(call)])
    return g.node("ConvTranspose", inputs, output_padding=_ints(call.attrs.output_padding), **attrs)


def _pool_common(a: Any) -> dict[str, Any]:
    _check_layouts(a, {"layout": "NCHW", "out_layout": "NCHW"})
    return {"kernel_shape": _ints(a.pool_size), "strides": _ints(a.strides),
            "pads": _ints(a.padding), "ceil_mode": int(bool(a.ceil_mode))}


@_register("relax.nn.max_pool2d")
def _max_pool2d(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    return g.node("MaxPool", [g.tensor(call.args[0])], dilations=_ints(a.dilation), **_pool_common(a))


@_register("relax.nn.avg_pool2d")
def _avg_pool2d(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    attrs = _pool_common(a)
    if any(d != 1 for d in _ints(a.dilation)):
        if g.opset < 19:
            raise BackendError("dilated average pooling needs opset 19")
        attrs["dilations"] = _ints(a.dilation)
    return g.node("AveragePool", [g.tensor(call.args[0])],
                  count_include_pad=int(bool(a.count_include_pad)), **attrs)


@_register("relax.nn.adaptive_avg_pool2d")
def _adaptive_avg_pool2d(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Static shapes: 1x1 is a global pool, an exact divisor is a plain average pool."""
    _check_layouts(call.attrs, {"layout": "NCHW", "out_layout": "NCHW"})
    x = g.tensor(call.args[0])
    in_hw, out_hw = _shape(call.args[0].ty)[2:], _shape(ty)[2:]
    if in_hw == out_hw:
        return g.node("Identity", [x])
    if out_hw == (1, 1):
        return g.node("GlobalAveragePool", [x])
    if any(i % o for i, o in zip(in_hw, out_hw, strict=True)):
        raise BackendError("adaptive pooling with uneven windows")
    k = [i // o for i, o in zip(in_hw, out_hw, strict=True)]
    return g.node("AveragePool", [x], kernel_shape=k, strides=k)


def _require_affine(attrs: Any) -> None:
    """TVM's lowering ignores center=False / scale=False (always applies beta and gamma),
    while the op's documentation says they are skipped: refuse rather than pick one."""
    if not (bool(attrs.center) and bool(attrs.scale)):
        raise BackendError("normalisation with center/scale disabled is ambiguous in TVM")


@_register("relax.nn.batch_norm")
def _batch_norm(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Inference batch norm; the tuple's mean/var fields are the moving statistics."""
    a = call.attrs
    if bool(a.training):
        raise BackendError("training-mode batch_norm")
    x, gamma, beta, mean, var = (g.tensor(v) for v in call.args)
    shape = _shape(call.args[0].ty)
    if len(shape) < 2 or _norm_axis(int(a.axis), len(shape)) != 1:
        raise BackendError("batch_norm only on axis 1")
    _require_affine(a)
    out = g.node("BatchNormalization", [x, gamma, beta, mean, var], epsilon=float(a.epsilon))
    return [out, mean, var]


@_register("relax.nn.layer_norm")
def _layer_norm(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    ndim = len(_shape(call.args[0].ty))
    axes = sorted(_norm_axis(int(ax), ndim) for ax in a.axes)
    if axes != list(range(ndim - len(axes), ndim)) or not axes:
        raise BackendError("layer_norm only over trailing axes")
    _require_affine(a)
    inputs = [g.tensor(v) for v in call.args]
    return g.node("LayerNormalization", inputs, axis=axes[0], epsilon=float(a.epsilon))


@_register("relax.nn.pad")
def _pad(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    widths = _ints(a.pad_width)
    if any(w < 0 for w in widths):
        raise BackendError("negative padding")
    mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}.get(str(a.pad_mode))
    if mode is None:
        raise BackendError(f"pad mode {a.pad_mode} not supported")
    if not any(widths):
        # A no-op (the importer emits these before every conv). Emitting it as Pad also
        # trips an ORT optimiser bug (Pad+Conv+BatchNorm fusion drops a tensor that the
        # graph still reads), so pass the input through.
        return g.tensor(call.args[0])
    pads = widths[0::2] + widths[1::2]  # Relax interleaves (before, after); ONNX wants begins, ends
    inputs = [g.tensor(call.args[0]), g.int64s(pads)]
    if mode == "constant":
        inputs.append(g.scalar(float(a.pad_value), _dtype(ty)))
    return g.node("Pad", inputs, mode=mode)


_REDUCE: dict[str, str] = {
    "relax.sum": "ReduceSum",
    "relax.mean": "ReduceMean",
    "relax.max": "ReduceMax",
    "relax.min": "ReduceMin",
    "relax.prod": "ReduceProd",
}


@_register(*_REDUCE)
def _reduce(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    op = _REDUCE[_op_name(call)]
    dtype = _arg_dtype(call, 0)
    if op == "ReduceMean" and dtype not in _FLOATS:
        raise BackendError("integer mean rounds differently")
    ndim = len(_shape(call.args[0].ty))
    axes = list(range(ndim)) if call.attrs.axis is None else sorted(
        _norm_axis(int(ax), ndim) for ax in call.attrs.axis)
    keep = int(bool(call.attrs.keepdims))
    x = g.tensor(call.args[0])
    if not axes:
        return g.node("Identity", [x])
    if op == "ReduceSum" or g.opset >= 18:
        return g.node(op, [x, g.int64s(axes)], keepdims=keep)
    return g.node(op, [x], axes=axes, keepdims=keep)


@_register("relax.variance")
def _variance(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Population variance, as TVM computes it: mean((x - mean(x))^2) over the axes."""
    dtype = _arg_dtype(call, 0)
    if dtype not in _FLOATS:
        raise BackendError("integer variance rounds differently")
    ndim = len(_shape(call.args[0].ty))
    axes = list(range(ndim)) if call.attrs.axis is None else sorted(
        _norm_axis(int(ax), ndim) for ax in call.attrs.axis)
    if not axes:
        raise BackendError("variance over no axes")
    x = g.tensor(call.args[0])
    keep = int(bool(call.attrs.keepdims))

    def mean(t: str, keepdims: int) -> str:
        if g.opset >= 18:
            return g.node("ReduceMean", [t, g.int64s(axes)], keepdims=keepdims)
        return g.node("ReduceMean", [t], axes=axes, keepdims=keepdims)

    d = g.node("Sub", [x, mean(x, 1)])
    return mean(g.node("Mul", [d, d]), keep)


@_register("relax.gather_elements")
def _gather_elements(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    if _arg_dtype(call, 1) not in ("int32", "int64"):
        raise BackendError("gather_elements needs integer indices")
    axis = _norm_axis(int(call.attrs.axis), len(_shape(call.args[0].ty)))
    return g.node("GatherElements", [g.tensor(call.args[0]), g.tensor(call.args[1])], axis=axis)


@_register("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")
def _reshape(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """All shapes are static: every view-like op is a Reshape to the output type."""
    return g.reshape(g.tensor(call.args[0]), _shape(ty))


@_register("relax.broadcast_to")
def _broadcast_to(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Expand", [g.tensor(call.args[0]), g.int64s(_shape(ty))])


@_register("relax.permute_dims")
def _permute_dims(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    ndim = len(_shape(call.args[0].ty))
    axes = call.attrs.axes
    perm = list(reversed(range(ndim))) if axes is None else [_norm_axis(int(x), ndim) for x in axes]
    return g.node("Transpose", [g.tensor(call.args[0])], perm=perm)


@_register("relax.concat")
def _concat(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    parts = g.value(call.args[0])
    if not isinstance(parts, list) or not parts or any(isinstance(p, list) for p in parts):
        raise BackendError("concat needs a flat tuple of tensors")
    if call.attrs.axis is None:  # TVM's own type inference rejects it; no reference semantics
        raise BackendError("concat without an axis")
    return g.node("Concat", parts, axis=int(call.attrs.axis))


@_register("relax.split")
def _split(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Split sizes come from the output tuple type, so they agree with TVM by construction."""
    ndim = len(_shape(call.args[0].ty))
    axis = _norm_axis(int(call.attrs.axis), ndim)
    sizes = [_shape(f)[axis] for f in ty.fields]
    x = g.tensor(call.args[0])
    if len(sizes) == 1:
        return [g.node("Identity", [x])]
    return g.node("Split", [x, g.int64s(sizes)], outputs=len(sizes), axis=axis)


@_register("relax.strided_slice")
def _strided_slice(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """ONNX Slice clamps out-of-range bounds like Python slicing, as TVM does."""
    x = g.tensor(call.args[0])
    axes, begin, end = (_const_ints(arg) for arg in call.args[1:4])
    strides = _const_ints(call.args[4]) if len(call.args) > 4 else [1] * len(axes)
    if 0 in strides:
        raise BackendError("zero stride")
    return g.node("Slice", [x, g.int64s(begin), g.int64s(end), g.int64s(axes), g.int64s(strides)])


@_register("relax.take")
def _take(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    x, idx = g.tensor(call.args[0]), g.tensor(call.args[1])
    shape = _shape(call.args[0].ty)
    axis = 0 if call.attrs.axis is None else _norm_axis(int(call.attrs.axis), len(shape))
    idx_dtype, mode = _arg_dtype(call, 1), str(call.attrs.mode)
    if idx_dtype not in ("int32", "int64"):
        raise BackendError(f"take with {idx_dtype} indices")
    if mode == "clip":
        idx = g.node("Clip", [idx, g.scalar(0, idx_dtype), g.scalar(shape[axis] - 1, idx_dtype)])
    elif mode == "wrap":  # ONNX Mod with fmod=0 follows the divisor's sign: result in [0, n)
        idx = g.node("Mod", [idx, g.scalar(shape[axis], idx_dtype)])
    elif mode != "fast":  # "nan" fills out-of-range with NaN: no ONNX equivalent
        raise BackendError(f"take mode {mode} not supported")
    return g.node("Gather", [x, idx], axis=axis)


@_register("relax.index_tensor")
def _index_tensor(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """x[i0, i1, ...] with broadcast index tensors: stack the indices, then GatherND."""
    x = g.tensor(call.args[0])
    names = g.value(call.args[1])
    types = _flat_types(call.args[1].ty)
    if not isinstance(names, list) or not names or any(isinstance(n, list) for n in names):
        raise BackendError("index_tensor needs a flat tuple of index tensors")
    if any(_dtype(t) not in ("int32", "int64") for t in types):
        raise BackendError("index_tensor needs integer indices")
    batch = np.broadcast_shapes(*(_shape(t) for t in types))
    stacked = []
    for name, t in zip(names, types, strict=True):
        idx = g.cast(name, _dtype(t), "int64")
        if _shape(t) != batch:
            idx = g.node("Expand", [idx, g.int64s(batch)])
        stacked.append(g.reshape(idx, [*batch, 1]))
    index = stacked[0] if len(stacked) == 1 else g.node("Concat", stacked, axis=-1)
    return g.node("GatherND", [x, index])


@_register("relax.astype")
def _astype(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Cast", [g.tensor(call.args[0])], to=_ONNX_DTYPES[_dtype(ty)])


@_register("relax.where")
def _where(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    if _arg_dtype(call, 1) != _arg_dtype(call, 2):
        raise BackendError("where on mixed dtypes")
    return g.node("Where", [_as_bool(g, call, 0), g.tensor(call.args[1]), g.tensor(call.args[2])])


_CUMSUM_DTYPES = frozenset({"float32", "float64", "int32", "int64"})


@_register("relax.cumsum")
def _cumsum(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """ORT's CumSum has no bool/int8 kernels: accumulate in int64 (or float32), cast back."""
    src, out = _arg_dtype(call, 0), _dtype(ty)
    work = out if out in _CUMSUM_DTYPES else ("float32" if out in _FLOATS else "int64")
    x = g.cast(g.tensor(call.args[0]), src, work)
    axis = call.attrs.axis
    if axis is None:
        x, axis = g.reshape(x, [-1]), 0
    summed = g.node("CumSum", [x, g.scalar(int(axis), "int64")],
                    exclusive=int(bool(call.attrs.exclusive)))
    return g.cast(summed, work, out)


@_register("relax.arange")
def _arange(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Static: a constant, computed as TVM does (start + i * step, then cast)."""
    start, _, step = (_scalar(a) for a in call.args)
    (n,) = _shape(ty)
    work = np.int64 if isinstance(start, int) and isinstance(step, int) else np.float64
    arr = (work(start) + np.arange(n, dtype=work) * work(step)).astype(_dtype(ty))
    return g.node("Identity", [g.array(arr)])


def _fill(g: _Graph, fill: str, fill_dtype: str, ty: tvm.ir.Type) -> str:
    """A static-shape constant tensor: a scalar Expanded to the output shape."""
    return g.node("Expand", [g.cast(fill, fill_dtype, _dtype(ty)), g.int64s(_shape(ty))])


@_register("relax.full")
def _full(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _fill(g, g.tensor(call.args[1]), _arg_dtype(call, 1), ty)


@_register("relax.full_like")
def _full_like(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _fill(g, g.tensor(call.args[1]), _arg_dtype(call, 1), ty)


@_register("relax.zeros", "relax.zeros_like", "relax.ones", "relax.ones_like")
def _zeros_ones(g: _Graph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    value = 1 if "ones" in _op_name(call) else 0
    return _fill(g, g.scalar(value, _dtype(ty)), _dtype(ty), ty)


# ---------------------------------------------------------------------------------------
# Bindings and functions


def _translate_value(g: _Graph, value: Any, ty: tvm.ir.Type) -> Value:
    """The ONNX value of one binding's right-hand side."""
    if isinstance(value, relax.Call):
        if isinstance(value.op, relax.Function):
            return _inline(g, value.op, [g.value(a) for a in value.args])
        if isinstance(value.op, relax.Var) and isinstance(g.env.get(value.op), relax.Function):
            return _inline(g, g.env[value.op], [g.value(a) for a in value.args])
        if not isinstance(value.op, tvm.ir.Op):
            raise BackendError(f"call to {type(value.op).__name__} not supported")
        fn = _TRANSLATORS.get(value.op.name)
        if fn is None:
            raise BackendError(f"op {value.op.name} not supported")
        for t in _flat_types(ty):
            _dtype(t)
        try:
            return fn(g, value, ty)
        except (AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
            raise BackendError(f"{value.op.name}: cannot translate ({e})") from e
    if isinstance(value, relax.Var | relax.Tuple | relax.TupleGetItem) or _is_tensor_const(value):
        return g.value(value)
    raise BackendError(f"binding of {type(value).__name__} not supported")


def _translate_body(g: _Graph, body: Any) -> Value:
    if not isinstance(body, relax.SeqExpr):
        return g.value(body)
    for block in body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                raise BackendError(f"{type(binding).__name__} not supported")
            if isinstance(binding.value, relax.Function):
                g.env[binding.var] = binding.value  # inlined at its call sites
                continue
            g.hint = binding.var.name
            g.bind(binding.var, _translate_value(g, binding.value, binding.var.ty))
    return g.value(body.body)


def _inline(g: _Graph, func: relax.Function, args: list[Value]) -> Value:
    """Inline a local (e.g. composite) function: bind its params to the argument values."""
    for param, arg in zip(func.params, args, strict=True):
        g.env[param] = arg
    return _translate_body(g, func.body)


def _make_model(g: _Graph, outputs: list[str], out_types: list[tvm.ir.Type]) -> onnx.ModelProto:
    """Close the graph: an Identity per output gives distinct names even for aliases."""
    out_infos = []
    for i, (name, ty) in enumerate(zip(outputs, out_types, strict=True)):
        out_name = g.fresh(f"out{i}")
        g.nodes.append(helper.make_node("Identity", [name], [out_name]))
        out_infos.append(helper.make_tensor_value_info(out_name, _ONNX_DTYPES[_dtype(ty)], _shape(ty)))
    graph = helper.make_graph(g.nodes, "partune_region", g.inputs, out_infos, g.initializers)
    opset = helper.make_opsetid("", g.opset)
    model = helper.make_model(graph, opset_imports=[opset], producer_name="partune")
    model.ir_version = helper.find_min_ir_version_for([opset])
    return model


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its large initializers turned into typed inputs.

    The checker and shape inference need types, not weights; serialising 100 MB of weights
    twice would dominate the build. Small initializers (shapes, axes) stay for data propagation.
    """
    g = model.graph
    big = [t for t in g.initializer if int(np.prod(t.dims)) > 64]
    if not big:
        return model
    names = {t.name for t in big}
    inputs = [*g.input, *(helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in big)]
    small = [t for t in g.initializer if t.name not in names]
    graph = helper.make_graph(g.node, g.name, inputs, g.output, small)
    out = helper.make_model(graph, opset_imports=model.opset_import, producer_name=model.producer_name)
    out.ir_version = model.ir_version
    return out


def _check_types(model: onnx.ModelProto, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """onnx.checker must pass and strict shape inference must reproduce every Relax type."""
    skeleton = _skeleton(model)
    try:
        onnx.checker.check_model(skeleton)
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=True, strict_mode=True,
                                                     data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise BackendError(f"invalid ONNX graph: {e}") from e
    g = inferred.graph
    for info in [*g.value_info, *g.output, *g.input]:
        want = expected.get(info.name)
        if want is None or not info.type.HasField("tensor_type"):
            continue
        tt = info.type.tensor_type
        if tt.elem_type != _ONNX_DTYPES[want[0]]:
            raise BackendError(f"{info.name}: ONNX dtype {tt.elem_type}, Relax says {want[0]}")
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if None not in dims and tuple(dims) != want[1]:
                raise BackendError(f"{info.name}: ONNX shape {dims}, Relax says {list(want[1])}")


def _build(g: _Graph, result: Value, ret_ty: tvm.ir.Type) -> onnx.ModelProto:
    outputs, out_types = _flatten(result), _flat_types(ret_ty)
    if len(outputs) != len(out_types):
        raise BackendError("result does not match the return type")
    shapes = {name: shape for name, (_, shape) in g.expected.items()}
    shapes |= {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in g.inputs}
    ranks = {name: len(shape) for name, shape in shapes.items()}
    model = fuse_idioms(_make_model(g, outputs, out_types), ranks, shapes)
    _check_types(model, g.expected)
    return model


def relax_to_onnx(func: relax.Function, opset: int = MIN_OPSET) -> onnx.ModelProto:
    """Translate a static-shape Relax function into one checked ONNX model.

    Tensor params become graph inputs (in order), ``relax.Constant`` weights become
    initializers, and the returned tensor or (nested) tuple becomes the graph outputs,
    flattened in order. Raises ``BackendError`` on anything it cannot translate exactly.
    """
    if opset < MIN_OPSET:
        raise BackendError(f"opset {opset} < {MIN_OPSET}")
    g = _Graph(opset)
    for param in func.params:
        g.env[param] = g.add_input(param.name, param.ty)
    result = _translate_body(g, func.body)
    return _build(g, result, func.body.body.ty if isinstance(func.body, relax.SeqExpr) else func.ret_ty)


# ---------------------------------------------------------------------------------------
# accepts(): translate one binding, create a session for it, cache per signature


_ACCEPT_CACHE: dict[tuple, bool] = {}
_ACCEPT_LOCK = threading.Lock()


def _arg_key(expr: Any) -> Any:
    if isinstance(expr, relax.Tuple):
        return ("tuple", tuple(_arg_key(f) for f in expr.fields))
    if isinstance(expr, tvm.tirx.IntImm | tvm.tirx.FloatImm):
        return ("prim", str(expr.ty), expr.value)
    if isinstance(expr, relax.ShapeExpr):
        return ("shape", str(expr))
    return (type(expr).__name__, str(getattr(expr, "ty", None)))


def _binding_key(binding: relax.Binding) -> tuple:
    value = binding.value
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        head: Any = (value.op.name, str(value.attrs), tuple(_arg_key(a) for a in value.args))
    elif isinstance(value, relax.TupleGetItem):
        head = ("getitem", int(value.index), _arg_key(value.tuple_value))
    else:
        head = _arg_key(value)
    return (head, str(binding.var.ty))


def _placeholder(g: _Graph, ty: tvm.ir.Type) -> Value:
    if isinstance(ty, relax.TupleType):
        return [_placeholder(g, f) for f in ty.fields]
    return g.add_input("x", ty)


def _probe(binding: relax.Binding, opset: int) -> None:
    """Translate one binding into a one-op model and let ORT resolve its kernels."""
    import onnxruntime as ort

    if not isinstance(binding, relax.VarBinding):
        raise BackendError("not a VarBinding")
    g = _Graph(opset, placeholder_above=64)
    for var in relax.analysis.free_vars(binding.value):
        g.env[var] = _placeholder(g, var.ty)
    g.hint = "y"
    result = _translate_value(g, binding.value, binding.var.ty)
    g.bind(binding.var, result)
    model = _build(g, result, binding.var.ty)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def binding_accepted(binding: relax.Binding, opset: int = MIN_OPSET) -> bool:
    """Whether one binding translates and ORT has kernels for it (cached per signature)."""
    try:
        key = (opset, _binding_key(binding))
    except Exception:  # an unprintable binding is simply refused
        return False
    return probe_once(_ACCEPT_CACHE, _ACCEPT_LOCK, key, lambda: _probe(binding, opset))


def probe_once(cache: dict, lock: threading.Lock, key: Any, probe: Callable[[], object]) -> bool:
    """Whether ``probe()`` runs without raising, decided once per ``key`` and remembered.

    Any failure (translation, checker, the runtime refusing the graph) means refuse.
    """
    with lock:
        if key in cache:
            return cache[key]
    try:
        probe()
        ok = True
    except Exception:  # noqa: BLE001 - whatever the reason, the op is not accepted
        ok = False
    with lock:
        cache[key] = ok
    return ok


# ---------------------------------------------------------------------------------------
# The kernel: one session, I/O bound straight to the caller's buffers


def model_specs(model: onnx.ModelProto) -> tuple[list[Spec], list[Spec]]:
    """(name, dtype, shape) of the inputs and of the outputs of a region's ONNX graph."""
    graph = model.graph
    return ([(i.name, _info_dtype(i), _info_shape(i)) for i in graph.input],
            [(o.name, _info_dtype(o), _info_shape(o)) for o in graph.output])


class OrtRegionKernel(BoundKernel):
    """A built region: one ORT session whose I/O is bound to the caller's buffers by pointer
    (no copies: ORT writes the results straight into the destinations); see ``BoundKernel``.
    """

    def __init__(self, session: Any, ins: list[Spec], outs: list[Spec]) -> None:
        super().__init__(ins, outs)
        self.session = session
        self._live = {i.name for i in session.get_inputs()}  # ORT drops unused inputs

    def bind_zero_copy(self, args: Sequence[Any], ins: list[np.ndarray],
                       outs: list[np.ndarray]) -> Callable[[], Any]:
        """Bind every input and output by address; returns the cheapest way to run it."""
        binding = self.session.io_binding()
        ptrs = [a.data_ptr() for a in args]
        for view, ptr, (name, _, _) in zip(ins, ptrs[:len(ins)], self._in, strict=True):
            if name in self._live:
                binding.bind_input(name, "cpu", 0, view.dtype, view.shape, ptr)
        for view, ptr, (name, _, _) in zip(outs, ptrs[len(ins):], self._out, strict=True):
            binding.bind_output(name, "cpu", 0, view.dtype, view.shape, ptr)
        # The C-level objects skip the public wrapper's per-call Python checks.
        c_sess, c_bind = getattr(self.session, "_sess", None), getattr(binding, "_iobinding", None)
        if c_bind is not None and hasattr(c_sess, "run_with_iobinding"):
            return functools.partial(c_sess.run_with_iobinding, c_bind, None)
        return functools.partial(self.session.run_with_iobinding, binding)

    def bind_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], Any]:
        return functools.partial(self._run_copying, ins, outs)

    def _run_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
        feeds = {name: v for v, (name, _, _) in zip(ins, self._in, strict=True) if name in self._live}
        for dst, res in zip(outs, self.session.run(self.output_names, feeds), strict=True):
            np.copyto(dst, res)


def _info_dtype(info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


def _info_shape(info: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(d.dim_value for d in info.type.tensor_type.shape.dim)


def _session_options(threads: int, level: Any) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return so


# ORT graph optimisers left out of every session. SkipLayerNormFusion turns Add ->
# LayerNormalization into the contrib SkipLayerNormalization, whose CPU kernel (ORT 1.32) is
# 5-7x slower than the two ops it replaces: (1, 128, 256) 150 us vs 22 us, (1, 128, 768)
# 447 us vs 60 us, one thread. Users' exports rarely match the fusion (symbolic dims), but
# the static graphs relax_to_onnx emits do, so without this the translated distilbert ran
# 1.17x the user's file and deberta 1.01x (0.98x and 0.88x with it; CPU time, interleaved).
DISABLED_OPTIMIZERS: tuple[str, ...] = ("SkipLayerNormFusion",)


def make_session(model: onnx.ModelProto, threads: int, save_optimized: str | None = None) -> Any:
    """One CPU session: all graph optimisations but ``DISABLED_OPTIMIZERS``, sequential,
    ``threads`` intra-op threads.

    ORT's graph optimisers occasionally break a valid model (a fusion drops a tensor
    another node still reads); then the next lower optimisation level is tried.
    ``save_optimized``: where ORT writes the graph it optimised (``load_session`` runs it).
    """
    import onnxruntime as ort

    data = model.SerializeToString()
    levels = [ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              ort.GraphOptimizationLevel.ORT_DISABLE_ALL]
    first: Exception | None = None
    for level in levels:
        so = _session_options(threads, level)
        if save_optimized is not None:
            with contextlib.suppress(OSError):  # not a failed level's graph
                os.unlink(save_optimized)
            so.optimized_model_filepath = save_optimized
        try:
            return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"],
                                        disabled_optimizers=list(DISABLED_OPTIMIZERS))
        except Exception as e:  # noqa: BLE001 - try a lower level, report the first reason
            first = first or e
    raise BackendError(f"onnxruntime could not load the region: {first}") from first


def load_session(path: str, threads: int) -> Any:
    """A session of a graph ORT optimised before (``make_session(save_optimized=...)``): it is
    not optimised again. Such a graph may hold layout-specific ops (NCHWc) of this CPU."""
    import onnxruntime as ort

    so = _session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


_SPECS = "specs.json"  # a cached region kernel's input and output names, dtypes and shapes


def save_specs(directory: str, kernel: BoundKernel) -> None:
    doc = {side: [[n, str(d), list(s)] for n, d, s in specs]
           for side, specs in zip(("inputs", "outputs"), kernel.specs, strict=True)}
    with open(os.path.join(directory, _SPECS), "w") as f:
        json.dump(doc, f)


def load_specs(directory: str) -> tuple[list[Spec], list[Spec]]:
    with open(os.path.join(directory, _SPECS)) as f:
        doc = json.load(f)
    return tuple([(n, np.dtype(d), tuple(s)) for n, d, s in doc[side]]  # type: ignore[return-value]
                 for side in ("inputs", "outputs"))


class OnnxGraphBackend(Backend):
    """A graph-level CPU backend that takes a region as one ONNX graph (``relax_to_onnx``).

    onnxruntime and OpenVINO differ only in which ops they accept and how they compile
    and bind the graph (``kernel``); the translation and its checks are shared.
    """

    level = Level.COMPILER
    fusion_style = FusionStyle.ARBITRARY
    device_types = ("cpu",)
    caches_builds = True

    def __init__(self, opset: int = MIN_OPSET) -> None:
        if opset < MIN_OPSET:
            raise BackendError(f"opset {opset} < {MIN_OPSET}")
        self.opset = opset

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> Any:
        """Translate and compile; with a build cache active, load what was compiled before
        (nothing is translated then), or store what is compiled (build workers)."""
        if scope.device_type not in (None, *self.device_types):
            raise BackendError(f"{self.name} backend runs on cpu, not {scope.device_type}")
        entry = build_cache.current()
        if entry is not None:
            entry.refine(self.name, self.library_version(), self.opset)
            kernel = entry.load(lambda d: self.load_kernel(d, threads))
            if kernel is not None:
                return kernel
        return self.kernel(relax_to_onnx(func, self.opset), func, threads)

    @abstractmethod
    def kernel(self, model: onnx.ModelProto, func: relax.Function, threads: int) -> Any:
        """Compile the region's ONNX graph and return its destination-passing kernel
        (stored in the active build cache entry, if any, for ``load_kernel``)."""

    @abstractmethod
    def load_kernel(self, directory: str, threads: int) -> Any:
        """The kernel ``kernel`` stored in a build cache entry's directory."""

    @abstractmethod
    def library_version(self) -> str:
        """The compiler's version (a cached build of another version is not used)."""


_ORT_MODEL = "optimized.onnx"


class OnnxRuntimeBackend(OnnxGraphBackend):
    """ONNX Runtime on CPU: graph-level, takes any convex region as one ONNX graph."""

    name = "onnxruntime"

    def accepts(self, binding: relax.Binding) -> bool:
        return binding_accepted(binding, self.opset)

    def kernel(self, model: onnx.ModelProto, func: relax.Function, threads: int) -> OrtRegionKernel:
        """A session with all graph optimisations; a build worker stores the graph ORT optimised."""
        entry = build_cache.current()
        scratch = entry.scratch(".onnx") if entry is not None else None
        try:
            kernel = OrtRegionKernel(make_session(model, threads, scratch), *model_specs(model))
            if entry is not None and scratch is not None and os.path.exists(scratch):
                def write(d: str) -> None:
                    os.replace(scratch, os.path.join(d, _ORT_MODEL))
                    save_specs(d, kernel)

                entry.store(write)
        finally:
            if scratch is not None:
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
        return kernel

    def load_kernel(self, directory: str, threads: int) -> OrtRegionKernel:
        return OrtRegionKernel(load_session(os.path.join(directory, _ORT_MODEL), threads),
                               *load_specs(directory))

    def library_version(self) -> str:
        """ORT's version and the optimisers left out: a cached graph was optimised with them."""
        import onnxruntime as ort

        return "+".join([ort.__version__, *(f"no-{o}" for o in DISABLED_OPTIMIZERS)])

    def set_threads(self, threads: int) -> None:
        """Threads are per session (``build_region``); nothing process-wide to set."""
