"""A Relax region computed in int8: its matmuls and convolutions in quantize-dequantize form.

ONNX's QDQ form is how int8 travels between tools: a ``DequantizeLinear`` of int8 weights and
of a quantized activation feeding a ``MatMul`` or ``Conv``. onnxruntime and OpenVINO both
recognise it and run the op on integer kernels (onnxruntime's QDQ selectors, OpenVINO's
low-precision transformations), so one rewrite in Relax serves every backend that translates
the region to ONNX (``partune.backends.relax_onnx``).

- Weights (constants) are quantized per output channel, symmetric int8, from their own values.
- An activation is quantized per tensor, asymmetric uint8, from its range over the calibration
  data (``Range``). A convolution's output is quantized too: onnxruntime runs a convolution in
  int8 only as a whole QDQ unit (dequantized in, quantized out).
- With no calibrated range (a region timed alone), a placeholder range is used: the time of an
  int8 kernel does not depend on its scales, only its error does, and errors are judged on
  whole plans built with the calibrated ranges.

Weights use the full [-127, 127]. onnxruntime's guide suggests 7-bit weights (``reduce_range``)
on CPUs without VNNI, where ``vpmaddubsw`` sums u8 x s8 pairs into int16 and could saturate; on
this project's AVX2 machine neither onnxruntime 1.32 nor OpenVINO 2026.4 showed it (a 256-deep
matmul over post-ReLU activations: 1.2% error at 127 levels, 1.7% at 63, both libraries alike).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import tvm
from tvm import relax

INT8 = "int8"
Range = tuple[float, float]
PLACEHOLDER: Range = (-4.0, 4.0)  # any range times the same; only errors depend on it

_CONV = ("strides", "padding", "dilation", "groups", "data_layout", "kernel_layout", "out_layout")
# The ops int8 runs faster, with their attributes, their weight's output-channel axis, and whether
# their output is quantized too (a whole QDQ unit).
_OPS: dict[str, tuple[Callable[..., relax.Expr], tuple[str, ...], int, bool]] = {
    "relax.matmul": (relax.op.matmul, (), -1, True),
    "relax.nn.conv1d": (relax.op.nn.conv1d, _CONV, 0, True),
    "relax.nn.conv2d": (relax.op.nn.conv2d, _CONV, 0, True),
}


LEVELS = 127  # the largest int8 weight magnitude (see the module docstring)
# How ranges become int8 here, named in every calibration's digest: a change to it is a change to
# every int8 plan's values, which must then be measured again, not read from the store.
INT8_SCHEME = (
    f"qdq: weights s8 per channel +-{LEVELS}, activations u8 per tensor, conv/matmul out too"
)


def _f32(expr: relax.Expr) -> bool:
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and ty.dtype == "float32"


def _weight(expr: relax.Expr) -> np.ndarray | None:
    if isinstance(expr, tvm.ir.GenericConst) and _f32(expr):
        return expr.value.numpy()
    return None


def quantizes(value: relax.Expr) -> bool:
    """Whether ``value`` is a matmul or convolution of a float32 activation by a constant float32
    weight of two or more dimensions: what int8 makes faster, and what ``in_int8`` rewrites."""
    if not (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name in _OPS
        and _f32(value.args[0])
    ):
        return False
    w = _weight(value.args[1])
    return w is not None and w.ndim >= 2 and not isinstance(value.args[0], tvm.ir.GenericConst)


def activation_qparams(rng: Range) -> tuple[float, int]:
    """Scale and uint8 zero point of an activation ranging over ``rng`` (zero kept exact)."""
    lo, hi = min(float(rng[0]), 0.0), max(float(rng[1]), 0.0)
    scale = (hi - lo) / 255.0 or 1.0
    return scale, int(np.clip(round(-lo / scale), 0, 255))


def _qdq_activation(x: relax.Expr, rng: Range) -> relax.Expr:
    scale, zero = activation_qparams(rng)
    s = relax.const(np.float32(scale))
    z = relax.const(np.uint8(zero))
    return relax.op.dequantize(relax.op.quantize(x, s, z, axis=-1, out_dtype="uint8"), s, z)


def _dq_weight(w: np.ndarray, axis: int, levels: int) -> relax.Expr:
    axis = axis % w.ndim
    other = tuple(i for i in range(w.ndim) if i != axis)
    peak = np.abs(w).max(axis=other, keepdims=True)
    scale = np.where(peak > 0, peak / levels, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -levels, levels).astype(np.int8)
    return relax.op.dequantize(
        relax.const(q),
        relax.const(scale.reshape(-1)),
        relax.const(np.zeros(scale.size, np.int8)),
        axis=axis,
    )


def in_int8(
    value: relax.Expr,
    inputs: Range | None = None,
    output: Range | None = None,
    levels: int = LEVELS,
) -> relax.Expr:
    """``value`` (see ``quantizes``) in QDQ form: its activation quantized over ``inputs``, its
    weight per output channel into ``levels``, and a convolution's output over ``output``
    (``PLACEHOLDER`` for a range not given); any other value unchanged."""
    if not quantizes(value):
        return value
    make, fields, axis, quantize_out = _OPS[value.op.name]
    attrs = {name: getattr(value.attrs, name) for name in fields}
    x = _qdq_activation(value.args[0], inputs or PLACEHOLDER)
    y = make(x, _dq_weight(_weight(value.args[1]), axis, levels), **attrs)
    return _qdq_activation(y, output or PLACEHOLDER) if quantize_out else y


@relax.expr_functor.mutator
class _Int8Mutator(relax.PyExprMutator):
    def __init__(self, ranges: Mapping[str, Range], levels: int) -> None:
        super().__init__()
        self.ranges, self.levels = ranges, levels

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if not quantizes(value):
            return super().visit_var_binding_(binding)
        arg = value.args[0]
        value = in_int8(
            value,
            self.ranges.get(arg.name) if isinstance(arg, relax.Var) else None,
            self.ranges.get(binding.var.name),
            self.levels,
        )
        dataflow = isinstance(binding.var, relax.DataflowVar)
        emit = self.builder_.emit if dataflow else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(value, name_hint=binding.var.name))
        return None


def function_in_int8(
    func: relax.Function, ranges: Mapping[str, Range] | None = None, levels: int = LEVELS
) -> relax.Function:
    """Every matmul and convolution of ``func`` that ``quantizes`` in QDQ form; ``ranges`` by
    variable name (the activation read, the convolution's result), placeholders elsewhere."""
    return _Int8Mutator(ranges or {}, levels).visit_expr(func)


def quantize_int8(ranges: Mapping[str, Range] | None = None, levels: int = LEVELS):
    """``function_in_int8`` as a named TVM pass over every Relax function of a module."""

    @relax.transform.function_pass(opt_level=0, name="QuantizeInt8")
    def transform(
        func: relax.Function, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext
    ) -> relax.Function:
        return function_in_int8(func, ranges, levels)

    return transform
