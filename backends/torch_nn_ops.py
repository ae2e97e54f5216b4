"""Translators for the Relax nn ops: softmax, layer and batch norm, conv2d, pooling,
pad and matmul, with the conv/pool helpers (``pad4``, ``conv2d_fn``) the program reuses
for fused convolutions.

One family of the op translators (see ``torch_ops``), kept apart from the element-wise,
reduction and shape families so each module stays about one kind of op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from partune.backends.torch_op_registry import (
    FLOATS,
    INTS,
    TORCH_DTYPES,
    OpCall,
    OpFn,
    identity,
    ints,
    norm_axis,
    op,
)

# --------------------------------------------------------------------------- nn


@op("relax.nn.softmax", "relax.nn.log_softmax")
def tr_softmax(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    axis = int(o.attrs.axis)
    fn = F.softmax if o.call.op.name == "relax.nn.softmax" else F.log_softmax
    return lambda x: fn(x, dim=axis)


@op("relax.nn.layer_norm")
def tr_layer_norm(o: OpCall) -> OpFn:
    """ATen's layer norm normalises trailing dimensions only.

    TVM's legalisation ignores ``center=False``/``scale=False`` (it always applies both)
    while the op's documentation says otherwise, so those are refused rather than guessed.
    """
    o.dtypes_in(FLOATS)
    o.need(bool(o.attrs.center) and bool(o.attrs.scale), "center/scale off (TVM ignores them)")
    shape, _ = o.arg(0)
    nd = len(shape)
    axes = sorted(norm_axis(int(a), nd) for a in o.attrs.axes)
    o.need(axes == list(range(nd - len(axes), nd)), f"axes {axes} are not trailing")
    norm_shape = shape[nd - len(axes) :]
    eps = float(o.attrs.epsilon)
    return lambda x, g, b: F.layer_norm(x, norm_shape, g, b, eps)


@op("relax.nn.batch_norm")
def tr_batch_norm(o: OpCall) -> OpFn:
    """Inference batch norm; returns (y, moving_mean, moving_var) as Relax does."""
    o.dtypes_in(FLOATS)
    o.need(not bool(o.attrs.training), "training mode")
    nd = len(o.arg(0)[0])
    o.need(nd >= 2 and norm_axis(int(o.attrs.axis), nd) == 1, "channel axis must be 1")
    eps, center, scale = float(o.attrs.epsilon), bool(o.attrs.center), bool(o.attrs.scale)

    def batch_norm(
        x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, m: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        y = F.batch_norm(x, m, v, g if scale else None, b if center else None, False, 0.0, eps)
        return (y, m, v)

    return batch_norm


def pad4(padding: Sequence[int]) -> tuple[int, int, int, int]:
    """Relax 2-d padding as (top, left, bottom, right)."""
    p = ints(padding)
    if len(p) == 1:
        return (p[0],) * 4
    if len(p) == 2:
        return (p[0], p[1], p[0], p[1])
    return p[0], p[1], p[2], p[3]


def check_nchw(o: OpCall, *layouts: tuple[str, str]) -> None:
    for attr, want in layouts:
        got = getattr(o.attrs, attr)
        o.need(got in (want, None, ""), f"{attr} {got} is not {want}")


@op("relax.nn.conv2d")
def tr_conv2d(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    check_nchw(o, ("data_layout", "NCHW"), ("kernel_layout", "OIHW"), ("out_layout", "NCHW"))
    out_dtype = o.attrs.out_dtype
    o.need(out_dtype is None or str(out_dtype) in ("", "void", o.arg(0)[1]), "out_dtype differs")
    return conv2d_fn(
        pad4(o.attrs.padding),
        ints(o.attrs.strides),
        ints(o.attrs.dilation),
        int(o.attrs.groups),
        bias=False,
    )


def conv2d_fn(
    padding: tuple[int, int, int, int],
    strides: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
    bias: bool,
) -> OpFn:
    """F.conv2d with Relax's (top, left, bottom, right) padding; asymmetric pads go first."""
    top, left, bottom, right = padding
    if top == bottom and left == right:
        sym: tuple[int, int] = (top, left)
        pre: tuple[int, ...] | None = None
    else:
        sym, pre = (0, 0), (left, right, top, bottom)

    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if pre is not None:
            x = F.pad(x, pre)
        return F.conv2d(x, w, b, strides, sym, dilation, groups)

    if bias:
        return conv
    return lambda x, w: conv(x, w)


def pool_args(
    o: OpCall,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """Kernel, strides, dilation and symmetric padding, refusing what ATen pools cannot do."""
    o.dtypes_in(FLOATS)
    check_nchw(o, ("layout", "NCHW"), ("out_layout", "NCHW"))
    k, s, d = ints(o.attrs.pool_size), ints(o.attrs.strides), ints(o.attrs.dilation)
    top, left, bottom, right = pad4(o.attrs.padding)
    o.need(top == bottom and left == right, "asymmetric padding")
    o.need(2 * top <= k[0] and 2 * left <= k[-1], "padding larger than half the window")
    return k, s, d, (top, left)


@op("relax.nn.max_pool2d")
def tr_max_pool2d(o: OpCall) -> OpFn:
    k, s, d, p = pool_args(o)
    ceil = bool(o.attrs.ceil_mode)
    return lambda x: F.max_pool2d(x, k, s, p, d, ceil_mode=ceil)


@op("relax.nn.avg_pool2d")
def tr_avg_pool2d(o: OpCall) -> OpFn:
    k, s, d, p = pool_args(o)
    o.need(all(v == 1 for v in d), "dilated average pooling")
    ceil, incl = bool(o.attrs.ceil_mode), bool(o.attrs.count_include_pad)
    return lambda x: F.avg_pool2d(x, k, s, p, ceil_mode=ceil, count_include_pad=incl)


@op("relax.nn.adaptive_avg_pool2d")
def tr_adaptive_avg_pool2d(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    check_nchw(o, ("layout", "NCHW"), ("out_layout", "NCHW"))
    size = o.out_shape[2:]
    return lambda x: F.adaptive_avg_pool2d(x, size)


@op("relax.nn.pad")
def tr_pad(o: OpCall) -> OpFn:
    """Constant padding only; Relax lists (before, after) per axis, torch from the last axis."""
    shape, dtype = o.arg(0)
    o.need(str(o.attrs.pad_mode) == "constant", f"pad_mode {o.attrs.pad_mode}")
    o.need(len(o.call.args) == 1, "pad value given as a tensor")
    width = ints(o.attrs.pad_width)
    o.need(len(width) == 2 * len(shape), "pad_width rank mismatch")
    value = float(o.attrs.pad_value)
    if dtype in INTS or dtype == "bool":
        value = int(value)
    if not any(width):
        return identity
    pairs = [width[2 * i : 2 * i + 2] for i in range(len(shape))]
    while pairs and not any(pairs[0]):  # torch pads only the trailing axes it is given
        pairs.pop(0)
    flat = tuple(v for pair in reversed(pairs) for v in pair)
    return lambda x: F.pad(x, flat, value=value)


@op("relax.matmul")
def tr_matmul(o: OpCall) -> OpFn:
    """Relax computes in out_dtype (inputs cast first); so does this."""
    o.dtypes_in(FLOATS)
    in_dtype = o.arg(0)[1]
    out_dtype = o.attrs.out_dtype
    if out_dtype is None or str(out_dtype) in ("", "void", in_dtype):
        return torch.matmul
    o.need(str(out_dtype) in FLOATS, f"out_dtype {out_dtype}")
    dt = TORCH_DTYPES[str(out_dtype)]
    return lambda a, b: torch.matmul(a.to(dt), b.to(dt))
