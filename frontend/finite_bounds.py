"""Bounds on the magnitude of every float value a model computes, where they can be proved.

Why (the softmax guards pass, ``frontend/passes/softmax_guards.py``, is what reads them): the
torch import of ``scaled_dot_product_attention`` guards each softmax against rows
that are all ``-inf`` (``where(all(x == -inf), 0, softmax(x))``: seven small ops per
attention). torch.onnx.export drops the guard, so onnxruntime and OpenVINO on the user's file
never pay it; in a Partune region it cost 9 us of bert-small's 55 (OpenVINO, one thread).
Where ``x`` provably never holds an infinity the guard is the identity, and removing it is
exact. A finite bound on ``|x|`` proves that: NaN may pass (it is never ``-inf``), an
infinity may not.

The bounds are conservative, in float64, from the constants' values and the ops' algebra:
a layer norm's output is bounded by ``sqrt(N) * max|gamma| + max|beta|`` whatever its
input (an infinite input makes NaN, not an infinity), a matmul's by ``K * |a| * |b|``, a
softmax's by 1, and so on. An op not listed, and any float model input, is unbounded.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from partune.core import known_shape

INF = math.inf
FLT_MAX = float(np.finfo(np.float32).max)
OVERFLOW = 2.0**128 - 2.0**103  # an exact result this large rounds to infinity in f32
ULP = 2.0**-24  # the relative error of one f32 rounding


def _rounded(exact: float, roundings: int = 1) -> float:
    """A bound on an f32 result whose exact value (from f32 operands) is at most ``exact`` in
    magnitude, computed with ``roundings`` roundings; INF if the result may overflow.

    The last rounding cannot overflow below ``OVERFLOW`` (round to nearest); earlier ones (a
    matmul's partial sums) each grow the bound by at most ``ULP``; 1e-15 covers this float64
    arithmetic. ``-3.4e38 + s`` (a mask of float32's lowest, added to bounded scores) stays
    finite, as it does in f32.
    """
    grown = exact * (1 + 1e-15) * (1 + ULP) ** max(roundings - 1, 0)
    return min(grown * (1 + ULP), FLT_MAX) if grown < OVERFLOW else INF


# Ops whose result is no larger than their (data) input: moves, selections, clamps, ReLU,
# GELU and SiLU (|gelu(x)| <= |x|).
_SAME = frozenset(
    {
        "relax.reshape",
        "relax.permute_dims",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.flatten",
        "relax.broadcast_to",
        "relax.strided_slice",
        "relax.take",
        "relax.index_tensor",
        "relax.gather_elements",
        "relax.gather_nd",
        "relax.nn.relu",
        "relax.max",
        "relax.min",
        "relax.nn.max_pool2d",
        "relax.negative",
        "relax.abs",
        "relax.nn.gelu",
        "relax.nn.gelu_tanh",
        "relax.nn.silu",
        "relax.clip",
        "relax.repeat",
        "relax.tile",
        "relax.split",
        "relax.concat",
        "relax.maximum",
        "relax.minimum",
        "relax.where",
    }
)
# Averages: no larger than their inputs, but computed as sums, which may overflow first.
_AVERAGES = frozenset({"relax.mean", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"})
_UNIT = frozenset(
    {"relax.nn.softmax", "relax.sigmoid", "relax.tanh", "relax.erf", "relax.sin", "relax.cos"}
)
_INT_MAX = {
    "bool": 1.0,
    "int8": 128.0,
    "uint8": 255.0,
    "int16": 2.0**15,
    "uint16": 2.0**16,
    "int32": 2.0**31,
    "uint32": 2.0**32,
    "int64": 2.0**63,
    "uint64": 2.0**64,
}


def known_dims(expr: relax.Expr) -> list[int] | None:
    shape = known_shape(expr.ty)
    return None if shape is None else list(shape)


def op_name(expr: relax.Expr) -> str | None:
    """The operator a call applies (None for anything else)."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) else None


def _dtype(expr: relax.Expr) -> str:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else ""


def _const_bound(value: np.ndarray) -> float:
    """The largest magnitude in a constant (NaN ignored: it is never an infinity)."""
    if not value.size:
        return 0.0
    if value.dtype == bool or np.issubdtype(value.dtype, np.integer):
        return max(abs(float(value.min())), abs(float(value.max())))
    with np.errstate(invalid="ignore"):
        high, low = np.nanmax(value, initial=-np.inf), np.nanmin(value, initial=np.inf)
    return (
        max(abs(float(high)), abs(float(low)))
        if np.isfinite(high) or np.isfinite(low)
        else (INF if np.isinf(value).any() else 0.0)
    )


def _const_min_abs(expr: relax.Expr) -> float:
    if not isinstance(expr, tvm.ir.GenericConst):
        return 0.0
    value = np.abs(expr.value.numpy().astype(np.float64))
    return float(value.min()) if value.size and not np.isnan(value).any() else 0.0


class _Bounds:
    def __init__(self, func: relax.Function) -> None:
        self.of: dict[relax.Var, float] = {}
        for p in func.params:
            self.of[p] = _INT_MAX.get(_dtype(p), INF)
        for block in func.body.blocks:
            for b in block.bindings:
                self.of[b.var] = self.expr(b.value) if isinstance(b, relax.VarBinding) else INF

    def expr(self, e: relax.Expr) -> float:
        if isinstance(e, relax.Var):
            return self.of.get(e, INF)
        if isinstance(e, tvm.ir.GenericConst):
            return _const_bound(e.value.numpy())
        if isinstance(e, relax.Tuple):
            return max((self.expr(f) for f in e.fields), default=0.0)
        if isinstance(e, relax.TupleGetItem):
            return self.expr(e.tuple_value)
        if op_name(e) is not None:
            if _dtype(e).startswith(("float", "bfloat")) and _dtype(e) != "float32":
                return INF  # the bounds assume f32's range and rounding
            try:
                return self.call(e)
            except (TypeError, ValueError, AttributeError, IndexError, OverflowError):
                return INF
        return INF

    def call(self, c: relax.Call) -> float:  # noqa: PLR0911 - one case per op family
        name, args = c.op.name, c.args
        b = [self.expr(a) for a in args]
        if name in _UNIT:
            return 1.0
        if name in ("relax.nn.layer_norm", "relax.nn.rms_norm"):
            # |normalised| <= sqrt(N - 1) whatever the input (an infinity in it gives NaN); the
            # 1e-3 covers the roundings of the mean, variance and scaling
            n = math.prod(known_dims(args[0])[int(a)] for a in c.attrs.axes)
            scale = b[1] if name == "relax.nn.rms_norm" or c.attrs.scale else 1.0
            beta = b[2] if name == "relax.nn.layer_norm" and c.attrs.center else 0.0
            return _rounded(math.sqrt(n) * (1 + 1e-3) * scale + beta, 4)
        if name == "relax.exp":
            return _rounded(math.exp(b[0]) * (1 + 1e-6)) if b[0] < 88 else INF
        if name in _SAME:
            if name in (
                "relax.take",
                "relax.index_tensor",
                "relax.gather_elements",
                "relax.gather_nd",
            ):
                return b[0]
            return (
                max(b)
                if name in ("relax.maximum", "relax.minimum", "relax.concat")
                else (max(b[1:]) if name == "relax.where" else b[0])
            )
        if name == "relax.astype":
            return min(b[0], _INT_MAX.get(_dtype(args[0]), INF))
        if INF in b:
            return INF  # (below: arithmetic, unbounded with an unbounded operand)
        if name in _AVERAGES:  # a sum of up to 2^24 terms of this size cannot overflow
            return b[0] if b[0] < FLT_MAX * 2.0**-25 else INF
        if name in ("relax.add", "relax.subtract"):
            return _rounded(b[0] + b[1])
        if name == "relax.multiply":
            return _rounded(b[0] * b[1])
        if name == "relax.divide":
            low = _const_min_abs(args[1])
            return _rounded(b[0] / low) if low > 0 else INF
        if name == "relax.matmul":
            k = known_dims(args[0])[-1]
            return _rounded(k * b[0] * b[1], 2 * k)
        if name in ("relax.nn.conv1d", "relax.nn.conv2d"):
            k = math.prod(known_dims(args[1])[1:])
            return _rounded(k * b[0] * b[1], 2 * k)
        if name == "relax.sum":
            dims = known_dims(args[0])
            axes = c.attrs.axis
            n = math.prod(dims) if axes is None else math.prod(dims[int(a)] for a in axes)
            return _rounded(n * b[0], n)
        if name == "relax.sqrt":
            return b[0] if b[0] <= 1 else math.sqrt(b[0]) * (1 + ULP)
        return INF


def magnitude_bounds(func: relax.Function) -> dict[relax.Var, float]:
    """For each var of ``func``'s bindings and params: a bound on the magnitude of every
    finite value it can hold, or ``inf`` where it may hold an infinity (or is not known)."""
    return _Bounds(func).of


def never_infinite(bound: float) -> bool:
    """Whether a value with this magnitude bound can never be an infinity in f32."""
    return bound <= FLT_MAX
