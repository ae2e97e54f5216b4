"""What every Relax op -> ATen translator is built on: the static type checks, the
``OpCall`` a translator is handed, and the ``OPS`` registry that ``@op`` fills.

Separate from the translator families (element-wise, nn, reductions, shapes) so that
each of them, and the fuser and program that read Relax types, can share these without
importing one another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import tvm
from tvm import relax

from partune.backends.base import BackendError

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
        """The given arguments (default: all, which must be tensors) share one dtype from
        ``allowed``."""
        if not idx:
            self.need(
                all(isinstance(a, relax.Var | GenericConst) for a in self.call.args),
                "non-tensor argument",
            )
            idx = tuple(range(len(self.call.args)))
        dts = {self.arg(i)[1] for i in idx}
        self.need(
            len(dts) == 1 and dts <= allowed, f"dtypes {sorted(dts)} not in {sorted(allowed)}"
        )


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
