"""A Relax region computed in bfloat16 by TVM's own lowering.

TVM has no bf16 switch like OpenVINO's inference precision or torch's autocast; it has bf16
storage and compute in TIR. So a bf16 region is rewritten the way autocast treats a torch
graph: the operands of each matmul and convolution are cast to bfloat16, and the op
accumulates and returns float32 (``out_dtype``). Element-wise ops, reductions and
normalisations stay in f32. Weights are constants, so TVM folds their casts at build
time and the region keeps half of their bytes; activations are cast where they are used.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

BF16 = "bfloat16"
_CONV = ("strides", "padding", "dilation", "groups", "data_layout", "kernel_layout", "out_layout")
_TRANSPOSED = (*_CONV[:2], "output_padding", *_CONV[2:])
# The ops that run on a CPU's bf16 dot-product instructions, their makers and their attributes.
_OPS: dict[str, tuple[Callable[..., relax.Expr], tuple[str, ...]]] = {
    "relax.matmul": (relax.op.matmul, ()),
    "relax.nn.conv1d": (relax.op.nn.conv1d, _CONV),
    "relax.nn.conv2d": (relax.op.nn.conv2d, _CONV),
    "relax.nn.conv3d": (relax.op.nn.conv3d, _CONV),
    "relax.nn.conv1d_transpose": (relax.op.nn.conv1d_transpose, _TRANSPOSED),
    "relax.nn.conv2d_transpose": (relax.op.nn.conv2d_transpose, _TRANSPOSED),
}


def _f32(expr: relax.Expr) -> bool:
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and ty.dtype == "float32"


def casts(value: relax.Expr) -> bool:
    """Whether ``value`` is a matmul or convolution on float32 operands: what bf16 makes faster,
    and what ``in_bf16`` rewrites. A region without one is no bf16 candidate: under TVM it would
    compute exactly as in f32, and elsewhere it gains little but pays two casts at its borders."""
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name in _OPS
        and _f32(value.args[0])
        and _f32(value.args[1])
    )


def in_bf16(value: relax.Expr) -> relax.Expr:
    """``value`` with its matmul or convolution computed on bf16 operands into an f32 result;
    any other value (see ``casts``) unchanged."""
    if not casts(value):
        return value
    make, fields = _OPS[value.op.name]
    a, b = value.args[0], value.args[1]
    attrs = {name: getattr(value.attrs, name) for name in fields}
    return make(relax.op.astype(a, BF16), relax.op.astype(b, BF16), **attrs, out_dtype="float32")


@relax.expr_functor.mutator
class _Bf16Mutator(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        return in_bf16(super().visit_call_(call))


def function_in_bf16(func: relax.Function) -> relax.Function:
    """Every matmul and convolution of ``func`` in bf16 (``in_bf16``); its signature unchanged."""
    return _Bf16Mutator().visit_expr(func)


@relax.transform.function_pass(opt_level=0, name="ComputeInBf16")
def compute_in_bf16(
    func: relax.Function, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext
) -> relax.Function:
    """``function_in_bf16`` as a named TVM pass over every Relax function of a module (a bf16
    region lifted on its own, or a whole model a user wants computed so)."""
    return function_in_bf16(func)
