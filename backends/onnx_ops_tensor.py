"""Translators of the Relax ops that reduce, reshape, index and create tensors.

All shapes are static, so view-like ops become a Reshape to the output type and creation
ops become constants. One of the op families whose tables ``onnx_ops`` joins.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from partune.backends.base import BackendError
from partune.backends.onnx_graph import (
    FLOATS,
    OnnxGraph,
    Translator,
    Value,
    arg_dtype,
    const_ints,
    flat_types,
    norm_axis,
    op_name,
    registrar,
    scalar_value,
    tensor_dtype,
    tensor_shape,
)

TRANSLATORS: dict[str, Translator] = {}
_register = registrar(TRANSLATORS)


_REDUCE: dict[str, str] = {
    "relax.sum": "ReduceSum",
    "relax.mean": "ReduceMean",
    "relax.max": "ReduceMax",
    "relax.min": "ReduceMin",
    "relax.prod": "ReduceProd",
}


@_register(*_REDUCE)
def _reduce(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    op = _REDUCE[op_name(call)]
    dtype = arg_dtype(call, 0)
    if op == "ReduceMean" and dtype not in FLOATS:
        raise BackendError("integer mean rounds differently")
    ndim = len(tensor_shape(call.args[0].ty))
    axes = (
        list(range(ndim))
        if call.attrs.axis is None
        else sorted(norm_axis(int(ax), ndim) for ax in call.attrs.axis)
    )
    keep = int(bool(call.attrs.keepdims))
    x = g.tensor(call.args[0])
    if not axes:
        return g.node("Identity", [x])
    if op == "ReduceSum" or g.opset >= 18:
        return g.node(op, [x, g.int64s(axes)], keepdims=keep)
    return g.node(op, [x], axes=axes, keepdims=keep)


@_register("relax.variance")
def _variance(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Population variance, as TVM computes it: mean((x - mean(x))^2) over the axes."""
    dtype = arg_dtype(call, 0)
    if dtype not in FLOATS:
        raise BackendError("integer variance rounds differently")
    ndim = len(tensor_shape(call.args[0].ty))
    axes = (
        list(range(ndim))
        if call.attrs.axis is None
        else sorted(norm_axis(int(ax), ndim) for ax in call.attrs.axis)
    )
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
def _gather_elements(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    if arg_dtype(call, 1) not in ("int32", "int64"):
        raise BackendError("gather_elements needs integer indices")
    axis = norm_axis(int(call.attrs.axis), len(tensor_shape(call.args[0].ty)))
    return g.node("GatherElements", [g.tensor(call.args[0]), g.tensor(call.args[1])], axis=axis)


@_register("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")
def _reshape(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """All shapes are static: every view-like op is a Reshape to the output type."""
    return g.reshape(g.tensor(call.args[0]), tensor_shape(ty))


@_register("relax.broadcast_to")
def _broadcast_to(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return g.node("Expand", [g.tensor(call.args[0]), g.int64s(tensor_shape(ty))])


@_register("relax.permute_dims")
def _permute_dims(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    ndim = len(tensor_shape(call.args[0].ty))
    axes = call.attrs.axes
    perm = list(reversed(range(ndim))) if axes is None else [norm_axis(int(x), ndim) for x in axes]
    return g.node("Transpose", [g.tensor(call.args[0])], perm=perm)


@_register("relax.concat")
def _concat(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    parts = g.value(call.args[0])
    if not isinstance(parts, list) or not parts or any(isinstance(p, list) for p in parts):
        raise BackendError("concat needs a flat tuple of tensors")
    if call.attrs.axis is None:  # TVM's own type inference rejects it; no reference semantics
        raise BackendError("concat without an axis")
    return g.node("Concat", parts, axis=int(call.attrs.axis))


@_register("relax.split")
def _split(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Split sizes come from the output tuple type, so they agree with TVM by construction."""
    ndim = len(tensor_shape(call.args[0].ty))
    axis = norm_axis(int(call.attrs.axis), ndim)
    sizes = [tensor_shape(f)[axis] for f in ty.fields]
    x = g.tensor(call.args[0])
    if len(sizes) == 1:
        return [g.node("Identity", [x])]
    return g.node("Split", [x, g.int64s(sizes)], outputs=len(sizes), axis=axis)


@_register("relax.strided_slice")
def _strided_slice(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """ONNX Slice clamps out-of-range bounds like Python slicing, as TVM does."""
    x = g.tensor(call.args[0])
    axes, begin, end = (const_ints(arg) for arg in call.args[1:4])
    strides = const_ints(call.args[4]) if len(call.args) > 4 else [1] * len(axes)
    if 0 in strides:
        raise BackendError("zero stride")
    return g.node("Slice", [x, g.int64s(begin), g.int64s(end), g.int64s(axes), g.int64s(strides)])


@_register("relax.take")
def _take(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    x, idx = g.tensor(call.args[0]), g.tensor(call.args[1])
    shape = tensor_shape(call.args[0].ty)
    axis = 0 if call.attrs.axis is None else norm_axis(int(call.attrs.axis), len(shape))
    idx_dtype, mode = arg_dtype(call, 1), str(call.attrs.mode)
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
def _index_tensor(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """x[i0, i1, ...] with broadcast index tensors: stack the indices, then GatherND."""
    x = g.tensor(call.args[0])
    names = g.value(call.args[1])
    types = flat_types(call.args[1].ty)
    if not isinstance(names, list) or not names or any(isinstance(n, list) for n in names):
        raise BackendError("index_tensor needs a flat tuple of index tensors")
    if any(tensor_dtype(t) not in ("int32", "int64") for t in types):
        raise BackendError("index_tensor needs integer indices")
    batch = np.broadcast_shapes(*(tensor_shape(t) for t in types))
    stacked = []
    for name, t in zip(names, types, strict=True):
        idx = g.cast(name, tensor_dtype(t), "int64")
        if tensor_shape(t) != batch:
            idx = g.node("Expand", [idx, g.int64s(batch)])
        stacked.append(g.reshape(idx, [*batch, 1]))
    index = stacked[0] if len(stacked) == 1 else g.node("Concat", stacked, axis=-1)
    return g.node("GatherND", [x, index])


_CUMSUM_DTYPES = frozenset({"float32", "float64", "int32", "int64"})


@_register("relax.cumsum")
def _cumsum(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """ORT's CumSum has no bool/int8 kernels: accumulate in int64 (or float32), cast back."""
    src, out = arg_dtype(call, 0), tensor_dtype(ty)
    work = out if out in _CUMSUM_DTYPES else ("float32" if out in FLOATS else "int64")
    x = g.cast(g.tensor(call.args[0]), src, work)
    axis = call.attrs.axis
    if axis is None:
        x, axis = g.reshape(x, [-1]), 0
    summed = g.node(
        "CumSum", [x, g.scalar(int(axis), "int64")], exclusive=int(bool(call.attrs.exclusive))
    )
    return g.cast(summed, work, out)


@_register("relax.arange")
def _arange(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Static: a constant, computed as TVM does (start + i * step, then cast)."""
    start, _, step = (scalar_value(a) for a in call.args)
    (n,) = tensor_shape(ty)
    work = np.int64 if isinstance(start, int) and isinstance(step, int) else np.float64
    arr = (work(start) + np.arange(n, dtype=work) * work(step)).astype(tensor_dtype(ty))
    return g.node("Identity", [g.array(arr)])


def _fill(g: OnnxGraph, fill: str, fill_dtype: str, ty: tvm.ir.Type) -> str:
    """A static-shape constant tensor: a scalar Expanded to the output shape."""
    return g.node(
        "Expand", [g.cast(fill, fill_dtype, tensor_dtype(ty)), g.int64s(tensor_shape(ty))]
    )


@_register("relax.full")
def _full(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _fill(g, g.tensor(call.args[1]), arg_dtype(call, 1), ty)


@_register("relax.full_like")
def _full_like(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    return _fill(g, g.tensor(call.args[1]), arg_dtype(call, 1), ty)


@_register("relax.zeros", "relax.zeros_like", "relax.ones", "relax.ones_like")
def _zeros_ones(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    value = 1 if "ones" in op_name(call) else 0
    return _fill(g, g.scalar(value, tensor_dtype(ty)), tensor_dtype(ty), ty)
