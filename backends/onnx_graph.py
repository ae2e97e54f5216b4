"""The ONNX graph under construction and the Relax type helpers the translation shares.

``OnnxGraph`` collects ONNX nodes, initializers and graph inputs while the per-op translators
(``onnx_ops``) fill it, and records the type every Relax binding must have, which
``relax_to_onnx`` checks the finished model against. It lives apart from both so that the
op families and the function-level translation share one builder without importing
each other; ``registrar`` makes the decorator each op family files its translators with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from partune.backends.base import BackendError

Value = Any  # an ONNX tensor name (str), or a list of Values for a Relax tuple
Translator = Callable[["OnnxGraph", relax.Call, tvm.ir.Type], Value]

ONNX_DTYPES: dict[str, int] = {
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
FLOATS = frozenset({"float16", "float32", "float64"})


# ---------------------------------------------------------------------------------------
# Relax type helpers


def tensor_dtype(ty: tvm.ir.Type) -> str:
    """The element dtype of a tensor type, refusing what ONNX cannot hold."""
    if not isinstance(ty, relax.TensorType):
        raise BackendError(f"expected a tensor, got {ty}")
    dtype = str(ty.dtype)
    if dtype not in ONNX_DTYPES:
        raise BackendError(f"dtype {dtype} not supported")
    return dtype


def tensor_shape(ty: tvm.ir.Type) -> tuple[int, ...]:
    """The static shape of a tensor type (every region the search builds is static)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise BackendError(f"expected a tensor of known shape, got {ty}")
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        raise BackendError(f"dynamic shape {ty.shape} not supported")
    return tuple(int(d) for d in dims)


def int_list(values: Any) -> list[int]:
    return [int(v) for v in values]


def scalar_value(expr: Any) -> int | float:
    """The Python value of a constant primitive argument (IntImm / FloatImm)."""
    if isinstance(expr, tvm.tirx.IntImm | tvm.tirx.FloatImm):
        return expr.value
    raise BackendError(f"expected a constant scalar, got {expr}")


def const_ints(expr: Any) -> list[int]:
    """A tuple of constant integers (a relax.Tuple of IntImm, or a static ShapeExpr)."""
    items = expr.values if isinstance(expr, relax.ShapeExpr) else expr.fields
    return [int(scalar_value(v)) for v in items]


def flat_types(ty: tvm.ir.Type) -> list[tvm.ir.Type]:
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in flat_types(f)]
    return [ty]


def flat_names(value: Value) -> list[str]:
    if isinstance(value, list):
        return [n for v in value for n in flat_names(v)]
    return [value]


def is_tensor_const(expr: Any) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.ty, relax.TensorType)


def norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise BackendError(f"axis {axis} out of range for rank {ndim}")
    return axis % ndim if ndim else 0


def arg_dtype(call: relax.Call, i: int) -> str:
    return tensor_dtype(call.args[i].ty)


def op_name(call: relax.Call) -> str:
    return call.op.name


# ---------------------------------------------------------------------------------------
# Graph builder


class OnnxGraph:
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
        self.inputs.append(
            helper.make_tensor_value_info(name, ONNX_DTYPES[tensor_dtype(ty)], tensor_shape(ty))
        )
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
        dtype = tensor_dtype(ty)
        size = int(np.prod(tensor_shape(ty)))
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
        if is_tensor_const(expr):
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
        return name if src == dst else self.node("Cast", [name], to=ONNX_DTYPES[dst])

    def reshape(self, name: str, shape: Sequence[int]) -> str:
        return self.node("Reshape", [name, self.int64s(shape)])

    def bind(self, var: relax.Var, value: Value) -> None:
        """Record a binding and the type ONNX shape inference must agree with."""
        names, types = flat_names(value), flat_types(var.ty)
        if len(names) != len(types):
            raise BackendError(f"{var.name}: {len(names)} values for type {var.ty}")
        self.env[var] = value
        for name, ty in zip(names, types, strict=True):
            self.expected.setdefault(name, (tensor_dtype(ty), tensor_shape(ty)))


# ---------------------------------------------------------------------------------------
# Translator tables: Relax op name -> translator, one table per op family (``onnx_ops``)


def registrar(table: dict[str, Translator]) -> Callable[..., Callable[[Translator], Translator]]:
    """The ``_register(*op_names)`` decorator of an op family: files a translator in ``table``."""

    def _register(*names: str) -> Callable[[Translator], Translator]:
        def deco(fn: Translator) -> Translator:
            for n in names:
                table[n] = fn
            return fn

        return deco

    return _register
