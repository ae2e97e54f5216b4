"""The torch backend: runs Relax regions on PyTorch's ATen kernels (oneDNN/MKL, cuDNN/cuBLAS).

Why a library backend is worth having: ATen's convolutions and GEMMs are tuned, while
untuned TVM lowers them 100x-250x slower. A region is translated once, at build time,
into a flat list of closures over ATen calls; the per-call cost is a loop over that
list. Peepholes inside a region make one kernel out of several ops:

- conv2d absorbs a zero pad before it, and after it constant per-channel adds and
  multiplies and inference batch norms (all folded into its weight and bias), residual
  adds, reshapes and activations (applied in place);
- matmul with a constant weight (also ``permute_dims(W)``) becomes F.linear (addmm) and
  absorbs the same but batch norm, per output feature;
- the exported ``_safe_softmax`` (nine bindings) becomes softmax plus a masked fill.

Sub-expressions of constants only (masks, position ids, transposed weights) are
evaluated once at build time. Scaled-dot-product attention is left decomposed: single-threaded
on CPU, ATen's fused kernel beat matmul-softmax-matmul by only ~1.15x at BERT-4x256 sizes.

The translator is the single source of truth: ``accepts`` says yes exactly when the
translator can build the binding, and ``build_region`` checks every step's shape and
dtype against the Relax types on the meta device before handing the kernel out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from tvm.relax import dpl

from partune.backends.base import Backend, BackendError, FusionStyle, Level, RegionKernel

if TYPE_CHECKING:
    from partune.core.scopes import SEScope

IntImm = tvm.tirx.IntImm
FloatImm = tvm.tirx.FloatImm
GenericConst = tvm.ir.GenericConst

OpFn = Callable[..., Any]
"""A translated op: called with the runtime values of the call's tensor arguments."""


class Unsupported(BackendError):
    """The translator cannot express this binding with ATen."""


TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
INTS = frozenset({"int8", "uint8", "int16", "int32", "int64"})
NUMERIC = FLOATS | INTS


# --------------------------------------------------------------------------- types


def tensor_type(ty: Any) -> tuple[tuple[int, ...], str]:
    """Static shape and dtype of a tensor type; torch needs both known at build time."""
    if not isinstance(ty, relax.TensorType):
        raise Unsupported(f"not a tensor type: {ty}")
    shape = ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        raise Unsupported(f"shape not static: {ty}")
    dims = []
    for d in shape.values:
        if not isinstance(d, IntImm) or int(d.value) < 0:
            raise Unsupported(f"symbolic or negative dimension in {ty}")
        dims.append(int(d.value))
    dtype = str(ty.dtype)
    if dtype not in TORCH_DTYPES:
        raise Unsupported(f"dtype {dtype} not supported")
    return tuple(dims), dtype


def check_type(ty: Any) -> None:
    """Accept static tensors and (nested) tuples of them."""
    if isinstance(ty, relax.TupleType):
        for f in ty.fields:
            check_type(f)
    else:
        tensor_type(ty)


def static_value(e: Any) -> Any:
    """Python value of an IR constant that is not a tensor (ints, floats, shapes, strings)."""
    if isinstance(e, IntImm):
        return bool(e.value) if str(e.ty) == "bool" else int(e.value)
    if isinstance(e, FloatImm):
        return float(e.value)
    if isinstance(e, tvm.ir.StringImm):
        return str(e.value)
    if isinstance(e, relax.ShapeExpr):
        return tuple(static_value(v) for v in e.values)
    if isinstance(e, relax.Tuple) and not isinstance(e, GenericConst):
        return tuple(static_value(f) for f in e.fields)
    raise Unsupported(f"not a static value: {type(e).__name__}")


def is_dynamic(e: Any) -> bool:
    """Whether an argument is a tensor (or tuple of tensors) passed to the op at run time."""
    if isinstance(e, (relax.Var, GenericConst)):
        return True
    if isinstance(e, relax.Tuple):
        return any(is_dynamic(f) for f in e.fields)
    return False


def ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


# --------------------------------------------------------------------------- op context


@dataclass(frozen=True)
class OpCall:
    """What a translator sees: the call, its result type, and the target device."""

    call: relax.Call
    out_ty: Any
    device: torch.device

    @property
    def attrs(self) -> Any:
        return self.call.attrs

    def arg(self, i: int) -> tuple[tuple[int, ...], str]:
        return tensor_type(self.call.args[i].ty)

    def static(self, i: int) -> Any:
        return static_value(self.call.args[i])

    @property
    def out(self) -> tuple[tuple[int, ...], str]:
        return tensor_type(self.out_ty)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out[0]

    @property
    def out_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.out[1]]

    def need(self, cond: bool, why: str) -> None:
        if not cond:
            raise Unsupported(f"{self.call.op.name}: {why}")

    def dtypes_in(self, allowed: frozenset[str], *idx: int) -> None:
        """The given arguments (default: all, which must be tensors) share one dtype from ``allowed``."""
        if not idx:
            self.need(all(isinstance(a, relax.Var | GenericConst) for a in self.call.args),
                      "non-tensor argument")
            idx = tuple(range(len(self.call.args)))
        dts = {self.arg(i)[1] for i in idx}
        self.need(len(dts) == 1 and dts <= allowed, f"dtypes {sorted(dts)} not in {sorted(allowed)}")


Translator = Callable[[OpCall], OpFn]


def identity(x: Any) -> Any:
    """Marker translation: the result is the argument (the builder aliases the slot)."""
    return x


OPS: dict[str, Translator] = {}


def op(*names: str) -> Callable[[Translator], Translator]:
    def register(fn: Translator) -> Translator:
        for n in names:
            OPS[n] = fn
        return fn

    return register


def norm_axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


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
    norm_shape = shape[nd - len(axes):]
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

    def batch_norm(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, m: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
    return conv2d_fn(pad4(o.attrs.padding), ints(o.attrs.strides), ints(o.attrs.dilation),
                     int(o.attrs.groups), bias=False)


def conv2d_fn(padding: tuple[int, int, int, int], strides: tuple[int, ...],
              dilation: tuple[int, ...], groups: int, bias: bool) -> OpFn:
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


def pool_args(o: OpCall) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, int]]:
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
    pairs = [width[2 * i: 2 * i + 2] for i in range(len(shape))]
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


# --------------------------------------------------------------------------- reductions


def reduce_dims(o: OpCall) -> tuple[tuple[int, ...], bool]:
    nd = len(o.arg(0)[0])
    axis = o.attrs.axis
    dims = tuple(range(nd)) if axis is None else tuple(norm_axis(int(a), nd) for a in axis)
    o.need(len(dims) > 0 or nd == 0, "empty axis list")
    return dims, bool(o.attrs.keepdims)


@op("relax.mean")
def tr_mean(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    dims, keep = reduce_dims(o)
    return (lambda x: torch.mean(x, dim=dims, keepdim=keep)) if dims else identity


@op("relax.sum", "relax.prod")
def tr_sum(o: OpCall) -> OpFn:
    """Relax keeps the input dtype (torch would widen integers to int64)."""
    o.dtypes_in(NUMERIC)
    dims, keep = reduce_dims(o)
    dt = o.out_dtype
    if o.call.op.name == "relax.sum":
        return (lambda x: torch.sum(x, dim=dims, keepdim=keep, dtype=dt)) if dims else identity

    def prod(x: torch.Tensor) -> torch.Tensor:
        for d in sorted(dims, reverse=True):
            x = torch.prod(x, dim=d, keepdim=keep, dtype=dt)
        return x

    return prod


@op("relax.max", "relax.min")
def tr_max(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC | {"bool"})
    dims, keep = reduce_dims(o)
    fn = torch.amax if o.call.op.name == "relax.max" else torch.amin
    return (lambda x: fn(x, dim=dims, keepdim=keep)) if dims else identity


@op("relax.cumsum")
def tr_cumsum(o: OpCall) -> OpFn:
    """Accumulates in the result dtype; a bool result (importers emit it) means 'any so far'."""
    shape, _ = o.arg(0)
    axis = o.attrs.axis
    flat = axis is None
    dim = 0 if flat else norm_axis(int(axis), len(shape))
    out = o.out_dtype
    acc = torch.int64 if out == torch.bool else out
    exclusive = bool(o.attrs.exclusive)

    def cumsum(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1) if flat else x
        y = torch.cumsum(x, dim, dtype=acc)
        if exclusive:
            y = y - x.to(acc)
        return y.to(out)

    return cumsum


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
    perm = tuple(reversed(range(nd))) if axes is None else tuple(norm_axis(int(a), nd) for a in axes)
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


# --------------------------------------------------------------------------- translation


def translate_call(call: relax.Call, out_ty: Any, device: torch.device) -> OpFn:
    """The ATen closure for one Relax call, or Unsupported."""
    if not isinstance(call.op, tvm.ir.Op):
        raise Unsupported("call to a non-operator")
    tr = OPS.get(call.op.name)
    if tr is None:
        raise Unsupported(f"op {call.op.name} has no translator")
    check_type(out_ty)
    for a in call.args:
        if is_dynamic(a):
            check_type(a.ty)
    return tr(OpCall(call, out_ty, device))


def check_binding(binding: Any) -> None:
    """Raise Unsupported unless ``binding`` translates (without touching constant data)."""
    if not isinstance(binding, relax.VarBinding):
        raise Unsupported(f"{type(binding).__name__} bindings are not supported")
    value, ty = binding.value, binding.var.ty
    if isinstance(value, relax.Call):
        translate_call(value, ty, torch.device("cpu"))
    elif isinstance(value, (relax.Var, GenericConst, relax.TupleGetItem)):
        check_type(ty)
    elif isinstance(value, relax.Tuple):
        for f in value.fields:
            if not is_dynamic(f):
                raise Unsupported("tuple of non-tensors")
        check_type(ty)
    else:
        raise Unsupported(f"binding value {type(value).__name__}")


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


def absorb(g: Graph, chain: Chain, i: int, var: relax.Var, linear: bool, channels: int) -> int | None:
    """Add binding ``i`` (the sole user of ``var``) to the chain; its last binding, or None."""
    value, out_ty = g.bindings[i].value, g.bindings[i].var.ty
    shape, dtype = tensor_type(var.ty)
    axis = len(shape) - 1 if linear else 1
    foldable = can_fold(chain, linear, shape, channels)
    name = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""
    if name in ("relax.add", "relax.multiply"):
        if tensor_type(out_ty) != (shape, dtype):
            return None
        other = other_arg(value, var)
        if foldable and per_channel(g, other, shape, dtype, axis):
            chain.folds.append(("bias" if name == "relax.add" else "mul", other))
            return i
        if (name == "relax.add" and isinstance(other, relax.Var) and not other.same_as(var)
                and tensor_type(other.ty) == (shape, dtype)):
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
    while chain.post and chain.post[-1][0] == "reshape" and is_view(g.bindings[chain.members[-1]].value):
        chain.post.pop()
        chain.members.pop()
        var = g.bindings[chain.members[-1]].var
    return var


RESHAPES = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")


def is_view(value: Any) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in RESHAPES


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


def follow(g: Graph, var: relax.Var, *names: str) -> list[int] | None:
    """Bindings of a single-user chain of calls from ``var`` with the given op names."""
    out = []
    for name in names:
        i = g.sole_user(var)
        if i is None or g.call(i, name) is None or not g.bindings[i].value.args[0].same_as(var):
            return None
        out.append(i)
        var = g.bindings[i].var
    return out


def is_scalar_const(e: Any, value: float) -> bool:
    if not isinstance(e, GenericConst) or e.value.numpy().size != 1:
        return False
    v = float(e.value.numpy().reshape(-1)[0])
    return v == value or (v != v and value != value)


def match_safe_softmax(g: Graph, i: int) -> Match | None:
    """torch's ``_safe_softmax`` as exported: softmax, zeroed on rows that are all -inf.

    The nine bindings (softmax, equal -inf, not, astype int8, max, astype bool, not,
    full_like 0, where) become softmax plus one in-place masked fill.
    """
    sm = g.call(i, "relax.nn.softmax")
    if sm is None:
        return None
    a, s_var = sm.args[0], g.bindings[i].var
    shape, dtype = tensor_type(a.ty)
    axis = norm_axis(int(sm.attrs.axis), len(shape))
    if dtype not in FLOATS or s_var in g.outputs:
        return None
    eq = [j for j in g.users.get(a, []) if (c := g.call(j, "relax.equal")) is not None
          and c.args[0].same_as(a) and is_scalar_const(c.args[1], float("-inf"))]
    if len(eq) != 1:
        return None
    rest = follow(g, g.bindings[eq[0]].var, "relax.logical_not", "relax.astype", "relax.max",
                  "relax.astype", "relax.logical_not")
    if rest is None:
        return None
    mx = g.bindings[rest[2]].value
    if mx.attrs.axis is None or [norm_axis(int(x), len(shape)) for x in mx.attrs.axis] != [axis] \
            or not bool(mx.attrs.keepdims):
        return None
    users = sorted(g.users.get(s_var, []))
    fills = [j for j in users if (c := g.call(j, "relax.full_like")) is not None and is_scalar_const(c.args[1], 0.0)]
    wheres = [j for j in users if g.call(j, "relax.where") is not None]
    if len(users) != 2 or len(fills) != 1 or len(wheres) != 1 or g.sole_user(g.bindings[fills[0]].var) != wheres[0]:
        return None
    w = g.bindings[wheres[0]].value
    if not (w.args[0].same_as(g.bindings[rest[-1]].var) and w.args[1].same_as(g.bindings[fills[0]].var)
            and w.args[2].same_as(s_var)) or g.sole_user(g.bindings[rest[-1]].var) != wheres[0]:
        return None
    members = [i, eq[0], *rest, fills[0], wheres[0]]
    return Chain(members, data=a, axis=axis), g.bindings[wheres[0]].var


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


# --------------------------------------------------------------------------- the builder


@dataclass
class Program:
    """Build-time state: slots, constant template, and the step list the kernel runs."""

    device: torch.device
    template: list[Any] = field(default_factory=list)
    constant: set[int] = field(default_factory=set)
    slots: dict[relax.Var, int] = field(default_factory=dict)
    steps: list[tuple[OpFn, tuple[int, ...], int]] = field(default_factory=list)
    expect: list[tuple[int, Any]] = field(default_factory=list)  # (slot, Relax type) to verify
    const_cache: dict[Any, int] = field(default_factory=dict)

    def new_slot(self, value: Any = None, constant: bool = False) -> int:
        self.template.append(value)
        if constant:
            self.constant.add(len(self.template) - 1)
        return len(self.template) - 1

    def const_slot(self, e: Any) -> int:
        """A Relax tensor constant, converted once (shared constants share one slot)."""
        if e not in self.const_cache:
            t = torch.from_numpy(e.value.numpy()).to(self.device)
            self.const_cache[e] = self.new_slot(t, constant=True)
        return self.const_cache[e]

    def value(self, e: Any) -> torch.Tensor:
        """The build-time value of a constant expression (no slot for a bare constant)."""
        if isinstance(e, GenericConst) and e not in self.const_cache:
            return torch.from_numpy(e.value.numpy()).to(self.device)
        slot = self.operand(e)
        if slot not in self.constant:
            raise BackendError("expected a build-time constant")
        return self.template[slot]

    def operand(self, e: Any) -> int:
        """The slot holding a dynamic argument; tuples of tensors get a packing step."""
        if isinstance(e, relax.Var):
            if e not in self.slots:
                raise BackendError(f"variable {e.name} used before its definition")
            return self.slots[e]
        if isinstance(e, GenericConst):
            return self.const_slot(e)
        if isinstance(e, relax.Tuple):
            ins = tuple(self.operand(f) for f in e.fields)
            return self.emit(lambda *xs: xs, ins, None)
        raise Unsupported(f"operand {type(e).__name__}")

    def emit(self, fn: OpFn, ins: tuple[int, ...], ty: Any) -> int:
        """Add a step, or run it now when all its inputs are constants (constant folding)."""
        if fn is identity:
            return ins[0]
        if all(i in self.constant for i in ins):
            with torch.no_grad():
                slot = self.new_slot(fn(*[self.template[i] for i in ins]), constant=True)
        else:
            slot = self.new_slot()
            self.steps.append((fn, ins, slot))
        if ty is not None:
            self.expect.append((slot, ty))
        return slot


def emit_binding(p: Program, b: relax.VarBinding) -> None:
    value, ty = b.value, b.var.ty
    if isinstance(value, relax.Call):
        fn = translate_call(value, ty, p.device)
        ins = tuple(p.operand(a) for a in value.args if is_dynamic(a))
        p.slots[b.var] = p.emit(fn, ins, ty)
    elif isinstance(value, relax.Var | GenericConst | relax.Tuple):
        p.slots[b.var] = p.operand(value)
    elif isinstance(value, relax.TupleGetItem):
        k = int(value.index)
        p.slots[b.var] = p.emit(lambda t: t[k], (p.operand(value.tuple_value),), ty)
    else:
        raise Unsupported(f"binding value {type(value).__name__}")


def fold_affine(p: Program, chain: Chain, channels: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-channel (scale, bias) in float64 from the chain's folds, applied in order."""
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    for kind, e in chain.folds:
        if kind in ("bias", "mul"):
            vec = p.value(e).double().reshape(-1).expand(channels)
            if kind == "bias":
                bias = vec.clone() if bias is None else bias + vec
                continue
            s, shift = vec, None
        else:
            gamma, beta, mean, var = (p.value(a).double() for a in e.args[1:])
            gamma = gamma if bool(e.attrs.scale) else torch.ones_like(gamma)
            beta = beta if bool(e.attrs.center) else torch.zeros_like(beta)
            s = gamma / torch.sqrt(var + float(e.attrs.epsilon))
            shift = beta - mean * s
        bias = shift if bias is None else bias * s + (0 if shift is None else shift)
        scale = s if scale is None else scale * s
    return scale, bias


def emit_conv(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    call = next(v for m in chain.members if (v := g.call(m, "relax.nn.conv2d")) is not None)
    pads = pad4(call.attrs.padding)
    data = call.args[0]
    if chain.pad is not None:
        pads = tuple(a + b for a, b in zip(pads, chain.pad, strict=True))
        data = g.bindings[chain.members[0]].value.args[0]
    weight = p.value(chain.weight)
    scale, bias = fold_affine(p, chain, weight.shape[0])
    if scale is not None:
        weight = (weight.double() * scale.reshape(-1, 1, 1, 1)).to(weight.dtype)
    conv = conv2d_fn(pads, ints(call.attrs.strides), ints(call.attrs.dilation),
                     int(call.attrs.groups), bias=True)
    ins = [p.operand(data), p.new_slot(weight, constant=True)]
    if bias is not None:
        ins.append(p.new_slot(bias.to(weight.dtype), constant=True))
    emit_chain(p, chain, last, conv, ins)


def emit_linear(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    call = g.bindings[chain.members[0]].value
    weight = p.value(chain.weight)
    scale, bias = fold_affine(p, chain, weight.shape[1])
    if scale is not None:
        weight = (weight.double() * scale.reshape(1, -1)).to(weight.dtype)
    ins = [p.operand(call.args[0]), p.new_slot(weight.t(), constant=True)]
    if bias is not None:
        ins.append(p.new_slot(bias.to(weight.dtype), constant=True))
    emit_chain(p, chain, last, F.linear, ins)


def post_op(kind: str, arg: Any, k: int) -> Callable[[torch.Tensor, tuple], Any]:
    """One post op; ``k`` is where its extra inputs start in the step's arguments."""
    if kind == "reshape":
        return lambda y, xs: y.reshape(arg)
    if kind == "add":
        return lambda y, xs: y.add_(xs[k])
    if kind == "bn_tuple":
        return lambda y, xs: (y, xs[k], xs[k + 1])
    return lambda y, xs: arg(y)


def emit_chain(p: Program, chain: Chain, last: relax.Var, anchor: OpFn, ins: list[int]) -> None:
    """One step: the anchor (with folded weight and bias), then its post ops in place."""
    n = len(ins)
    posts = []
    for kind, arg in chain.post:
        k = len(ins)
        if kind == "add":
            ins.append(p.operand(arg))
        elif kind == "bn_tuple":  # the moving mean and variance pass through unchanged
            ins.extend((p.operand(arg.args[3]), p.operand(arg.args[4])))
        posts.append(post_op(kind, arg, k))

    def fused(*xs: torch.Tensor) -> torch.Tensor:
        y = anchor(*xs[:n])
        for post in posts:
            y = post(y, xs)
        return y

    p.slots[last] = p.emit(fused, tuple(ins), last.ty)


def emit_safe_softmax(p: Program, g: Graph, chain: Chain, last: relax.Var) -> None:
    axis = chain.axis

    def safe_softmax(a: torch.Tensor) -> torch.Tensor:
        s = F.softmax(a, dim=axis)
        masked = a.amax(dim=axis, keepdim=True) == float("-inf")  # all -inf (NaN rows stay NaN)
        if a.device.type != "cpu" or bool(masked.any()):  # on CPU the check is cheaper than a fill
            s.masked_fill_(masked, 0.0)
        return s

    p.slots[last] = p.emit(safe_softmax, (p.operand(chain.data),), last.ty)


EMITTERS: dict[str, Callable[[Program, Graph, Chain, relax.Var], None]] = {
    "conv": emit_conv,
    "linear": emit_linear,
    "safe_softmax": emit_safe_softmax,
}


def region_bindings(func: relax.Function) -> tuple[list[relax.VarBinding], Any]:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return [], body
    bindings = [b for block in body.blocks for b in block.bindings]
    for b in bindings:
        if not isinstance(b, relax.VarBinding):
            raise Unsupported(f"{type(b).__name__} in region")
    return bindings, body.body


def output_paths(p: Program, e: Any, ty: Any, path: tuple[int, ...] = ()) -> list[tuple[int, tuple[int, ...]]]:
    """Flatten the returned value into (slot, tuple path) per output tensor, in order."""
    if isinstance(e, relax.Tuple) and not path:
        return [q for f in e.fields for q in output_paths(p, f, f.ty)]
    if isinstance(ty, relax.TupleType):
        return [q for k, f in enumerate(ty.fields) for q in output_paths(p, e, f, path + (k,))]
    return [(p.operand(e), path)]


def to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, tuple | list):
        return type(v)(to_meta(x) for x in v)
    return v


def same_type(v: Any, ty: Any) -> bool:
    if isinstance(ty, relax.TupleType):
        return isinstance(v, tuple | list) and len(v) == len(ty.fields) and all(
            same_type(x, f) for x, f in zip(v, ty.fields, strict=True))
    shape, dtype = tensor_type(ty)
    return isinstance(v, torch.Tensor) and tuple(v.shape) == shape and v.dtype == TORCH_DTYPES[dtype]


def describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype}"
    if isinstance(v, tuple | list):
        return "(" + ", ".join(describe(x) for x in v) + ")"
    return type(v).__name__


def verify(p: Program, inputs: list[tuple[int, Any]]) -> None:
    """Run the steps on meta tensors: every result must have its Relax shape and dtype."""
    env = [to_meta(v) for v in p.template]
    for slot, ty in inputs:
        shape, dtype = tensor_type(ty)
        env[slot] = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
    with torch.inference_mode():
        for fn, ins, out in p.steps:
            try:
                env[out] = fn(*[env[i] for i in ins])
            except NotImplementedError:
                return  # an op without a meta kernel: the rest cannot be checked statically
            except Exception as err:
                raise BackendError(f"translated step failed on meta tensors: {err}") from err
    for slot, ty in p.expect:
        if not same_type(env[slot], ty):
            raise BackendError(f"translation gives {describe(env[slot])} where Relax has {ty}")


def compile_region(func: relax.Function, device: torch.device) -> RegionKernel:
    """Translate ``func`` into a destination-passing kernel over DLPack tensors."""
    p = Program(device)
    inputs = []
    for param in func.params:
        if not isinstance(param.ty, relax.TensorType):
            raise Unsupported(f"parameter {param.name} is not a tensor")
        tensor_type(param.ty)
        p.slots[param] = p.new_slot()
        inputs.append((p.slots[param], param.ty))
    bindings, ret = region_bindings(func)
    g = make_graph(bindings, ret)
    chains, taken = plan_chains(g)
    for i, b in enumerate(bindings):
        if i in chains:
            kind, chain, last = chains[i]
            EMITTERS[kind](p, g, chain, last)
        elif i not in taken:
            emit_binding(p, b)
    outputs = output_paths(p, ret, ret.ty)
    verify(p, inputs)
    return make_kernel(p, [s for s, _ in inputs], outputs)


def make_kernel(p: Program, in_slots: list[int], outputs: list[tuple[int, tuple[int, ...]]]) -> RegionKernel:
    template, steps = list(p.template), list(p.steps)
    n_in, n_out = len(in_slots), len(outputs)
    from_dlpack = torch.from_dlpack

    def kernel(*args: Any) -> None:
        if len(args) != n_in + n_out:
            raise BackendError(f"kernel takes {n_in} inputs and {n_out} outputs, got {len(args)}")
        env = template.copy()
        try:
            for slot, a in zip(in_slots, args, strict=False):
                env[slot] = from_dlpack(a)
            with torch.inference_mode():
                for fn, ins, out in steps:
                    env[out] = fn(*[env[i] for i in ins])
                for (slot, path), dst in zip(outputs, args[n_in:], strict=True):
                    v = env[slot]
                    for k in path:
                        v = v[k]
                    from_dlpack(dst).copy_(v)
        except Exception as err:  # out-of-range indices, wrong input shapes, ...
            raise BackendError(f"torch kernel failed: {err}") from err

    kernel.num_steps = len(steps)  # type: ignore[attr-defined]
    return kernel


# --------------------------------------------------------------------------- patterns


def _activation_patterns(x: dpl.DFPattern) -> dict[str, dpl.DFPattern]:
    return {
        "relu": dpl.is_op("relax.nn.relu")(x),
        "gelu": dpl.is_op("relax.nn.gelu")(x),
        "gelu_tanh": dpl.is_op("relax.nn.gelu_tanh")(x),
        "silu": dpl.is_op("relax.nn.silu")(x),
        "clip": dpl.is_op("relax.clip")(x, dpl.wildcard(), dpl.wildcard()),
    }


def _constant() -> dpl.DFPattern:
    """A constant, or a reshaped/transposed one (importers emit W^T and (1, C, 1, 1) biases)."""
    c = dpl.is_const()
    return (c | dpl.is_op("relax.permute_dims")(c)
            | dpl.is_op("relax.reshape")(c, dpl.wildcard()))


def _bias_add(x: dpl.DFPattern) -> dpl.DFPattern:
    return dpl.is_op("relax.add")(x, _constant()) | dpl.is_op("relax.add")(_constant(), x)


def make_patterns() -> list[tuple[str, dpl.DFPattern]]:
    """Composites the builder turns into one ATen call, largest first.

    Attribute constraints keep out what ``accepts`` refuses (other layouts, training-mode
    batch norm, layer norm without centre or scale); dtypes are left to ``accepts``.
    """
    c = _constant
    nchw = {"data_layout": "NCHW", "kernel_layout": "OIHW", "out_layout": "NCHW"}
    conv = dpl.is_op("relax.nn.conv2d")(dpl.wildcard(), c()).has_attr(nchw)

    def bn(x: dpl.DFPattern) -> dpl.DFPattern:
        return dpl.is_op("relax.nn.batch_norm")(x, c(), c(), c(), c()).has_attr({"training": False, "axis": 1})

    conv_bn = bn(conv)  # rooted at the call: FuseOpsByPattern does not fuse a TupleGetItem root
    conv_bias = _bias_add(conv)
    linear = dpl.is_op("relax.matmul")(dpl.wildcard(), c())
    linear_bias = _bias_add(linear)
    pool = {"layout": "NCHW", "out_layout": "NCHW"}
    four = [(f"torch.conv2d_bn_{a}", p)
            for a, p in _activation_patterns(dpl.is_tuple_get_item(conv_bn, 0)).items()]
    three = [(f"torch.conv2d_bias_{a}", p) for a, p in _activation_patterns(conv_bias).items()]
    three += [(f"torch.matmul_bias_{a}", p) for a, p in _activation_patterns(linear_bias).items()]
    return four + [("torch.conv2d_bn", conv_bn)] + three + [
        ("torch.conv2d_bias", conv_bias),
        ("torch.matmul_bias", linear_bias),
        ("torch.batch_norm", bn(dpl.wildcard())),
        ("torch.conv2d", conv),
        ("torch.matmul", dpl.is_op("relax.matmul")(dpl.wildcard(), dpl.wildcard())),
        ("torch.layer_norm", dpl.is_op("relax.nn.layer_norm")(dpl.wildcard(), c(), c()).has_attr(
            {"center": True, "scale": True})),
        ("torch.softmax", dpl.is_op("relax.nn.softmax")(dpl.wildcard())),
        ("torch.max_pool2d", dpl.is_op("relax.nn.max_pool2d")(dpl.wildcard()).has_attr(pool)),
        ("torch.avg_pool2d", dpl.is_op("relax.nn.avg_pool2d")(dpl.wildcard()).has_attr(pool)),
        ("torch.adaptive_avg_pool2d", dpl.is_op("relax.nn.adaptive_avg_pool2d")(dpl.wildcard()).has_attr(pool)),
    ]


PATTERNS: list[tuple[str, dpl.DFPattern]] = make_patterns()


# --------------------------------------------------------------------------- the backend


def torch_device(scope: SEScope) -> torch.device:
    kind = scope.device_type or "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", scope.virtual_device_id or 0)
    raise BackendError(f"torch backend does not run on {kind}")


class TorchBackend(Backend):
    """PyTorch eager (ATen) kernels, one region at a time, with peephole composites."""

    name = "torch"
    level = Level.LIBRARY
    fusion_style = FusionStyle.NONE
    device_types = ("cpu", "cuda")

    def accepts(self, binding: relax.Binding) -> bool:
        try:
            check_binding(binding)
        except Unsupported:
            return False
        return True

    def why_not(self, binding: relax.Binding) -> str | None:
        """The reason ``accepts`` refuses ``binding`` (None when it accepts)."""
        try:
            check_binding(binding)
        except Unsupported as err:
            return str(err)
        return None

    def patterns(self) -> list[tuple[str, dpl.DFPattern]]:
        return PATTERNS

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> RegionKernel:
        self.set_threads(threads)
        try:
            return compile_region(func, torch_device(scope))
        except BackendError:
            raise
        except Exception as err:  # e.g. constant folding hit an ATen error
            raise BackendError(f"torch backend could not build the region: {err}") from err

    def set_threads(self, threads: int) -> None:
        if threads > 0 and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
