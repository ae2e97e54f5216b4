"""Translators for the Relax ops that move data without computing on it (reshapes,
permutes, broadcasts, concat, split, slicing, take, indexing) and that create tensors
(arange, full, zeros, ones).

One family of the op translators (see ``torch_ops``), kept apart from the element-wise,
nn and reduction families so each module stays about one kind of op.
"""

from __future__ import annotations

import math

import torch
from tvm import relax

from partune.backends.torch_op_registry import (
    OpCall,
    OpFn,
    identity,
    is_dynamic,
    norm_axis,
    op,
    tensor_type,
)

# --------------------------------------------------------------------------- shapes


@op("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")
def tr_reshape(o: OpCall) -> OpFn:
    """All four only relabel dimensions; the result type has the static shape."""
    shape = o.out_shape
    if o.arg(0)[0] == shape:
        return identity
    return lambda x: x.reshape(shape)


@op("relax.permute_dims")
def tr_permute_dims(o: OpCall) -> OpFn:
    nd = len(o.arg(0)[0])
    axes = o.attrs.axes
    perm = (
        tuple(reversed(range(nd))) if axes is None else tuple(norm_axis(int(a), nd) for a in axes)
    )
    if perm == tuple(range(nd)):
        return identity
    return lambda x: x.permute(perm)


@op("relax.broadcast_to")
def tr_broadcast_to(o: OpCall) -> OpFn:
    shape = o.out_shape
    if o.arg(0)[0] == shape:
        return identity
    return lambda x: x.expand(shape)


@op("relax.concat")
def tr_concat(o: OpCall) -> OpFn:
    parts = o.call.args[0]
    o.need(isinstance(parts, relax.Tuple), "concat of a tuple variable")
    dts = {tensor_type(f.ty)[1] for f in parts.fields}
    o.need(len(dts) == 1, "mixed dtypes")
    axis = o.attrs.axis
    if axis is None:
        return lambda xs: torch.cat([x.reshape(-1) for x in xs])
    dim = int(axis)
    return lambda xs: torch.cat(xs, dim=dim)


@op("relax.split")
def tr_split(o: OpCall) -> OpFn:
    """Sizes come from the result types, so sections and indices need no re-derivation."""
    shape, _ = o.arg(0)
    o.need(isinstance(o.out_ty, relax.TupleType), "result is not a tuple")
    dim = norm_axis(int(o.attrs.axis), len(shape))
    sizes = [tensor_type(f)[0][dim] for f in o.out_ty.fields]
    o.need(sum(sizes) == shape[dim], "split sizes do not cover the axis")
    return lambda x: torch.split(x, sizes, dim=dim)


@op("relax.strided_slice")
def tr_strided_slice(o: OpCall) -> OpFn:
    """Python slice semantics (negative wrap, clamping) are TVM's for positive strides."""
    shape, _ = o.arg(0)
    args = [o.static(i) for i in range(1, len(o.call.args))]
    axes, begin, end = args[0], args[1], args[2]
    strides = args[3] if len(args) > 3 else (1,) * len(axes)
    o.need(all(s > 0 for s in strides), "non-positive stride")
    index: list[slice] = [slice(None)] * len(shape)
    for a, b, e, s in zip(axes, begin, end, strides, strict=True):
        index[norm_axis(int(a), len(shape))] = slice(int(b), int(e), int(s))
    key = tuple(index)
    return lambda x: x[key]


@op("relax.take")
def tr_take(o: OpCall) -> OpFn:
    """index_select on the flattened indices; 'clip' clamps and 'wrap' wraps as in TVM."""
    shape, _ = o.arg(0)
    o.need(o.arg(1)[1] in ("int32", "int64"), "indices must be int32/int64")
    axis = o.attrs.axis
    flat = axis is None
    dim = 0 if flat else norm_axis(int(axis), len(shape))
    n = math.prod(shape) if flat else shape[dim]
    mode = str(o.attrs.mode)
    o.need(mode in ("fast", "clip", "wrap"), f"mode {mode}")
    out_shape = o.out_shape

    def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if flat:
            x = x.reshape(-1)
        if mode == "clip":
            idx = idx.clamp(0, n - 1)
        elif mode == "wrap":
            idx = torch.remainder(idx, n)
        return torch.index_select(x, dim, idx.reshape(-1)).reshape(out_shape)

    return take


@op("relax.index_tensor")
def tr_index_tensor(o: OpCall) -> OpFn:
    """NumPy advanced indexing on the leading axes, which is torch's too."""
    o.arg(0)
    idx = o.call.args[1]
    o.need(isinstance(idx, relax.Tuple), "indices must be a tuple")
    for f in idx.fields:
        o.need(tensor_type(f.ty)[1] in ("int32", "int64"), "indices must be int32/int64")
    return lambda x, ix: x[tuple(ix)]


# --------------------------------------------------------------------------- creation


@op("relax.arange")
def tr_arange(o: OpCall) -> OpFn:
    start, end, step = (o.static(i) for i in range(3))
    dt, dev = o.out_dtype, o.device
    return lambda: torch.arange(start, end, step, dtype=dt, device=dev)


@op("relax.full")
def tr_full(o: OpCall) -> OpFn:
    shape, dt = o.static(0), o.out_dtype
    o.need(is_dynamic(o.call.args[1]), "fill value is not a tensor")
    return lambda v: v.to(dt).expand(shape).contiguous()


@op("relax.full_like")
def tr_full_like(o: OpCall) -> OpFn:
    dt = o.out_dtype
    o.need(is_dynamic(o.call.args[0]) and is_dynamic(o.call.args[1]), "fill value is not a tensor")
    return lambda x, v: v.to(dt).expand(x.shape).contiguous()


@op("relax.zeros", "relax.ones")
def tr_zeros(o: OpCall) -> OpFn:
    shape, dt, dev = o.static(0), o.out_dtype, o.device
    fn = torch.zeros if o.call.op.name == "relax.zeros" else torch.ones
    return lambda: fn(shape, dtype=dt, device=dev)


@op("relax.zeros_like", "relax.ones_like")
def tr_zeros_like(o: OpCall) -> OpFn:
    dt = o.out_dtype
    fn = torch.zeros_like if o.call.op.name == "relax.zeros_like" else torch.ones_like
    return lambda x: fn(x, dtype=dt)
