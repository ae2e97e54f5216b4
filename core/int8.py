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

Without VNNI, ``vpmaddubsw`` sums u8 x s8 products in pairs into int16, which saturates when
both are at full range: measured on this project's AVX2 machine, a two-matmul block was 6-13%
off f32 at 8-bit weights and activations, onnxruntime 1.32 and OpenVINO 2026.4 alike. The bit
is taken from the activations there (u8 in [0, 127], ``INT8_ACTIVATION_LEVELS``; 2 x 127 x 127 fits
int16), not from the weights as onnxruntime's ``reduce_range`` does: on squeezenet the whole
model in int8 was 1.2% off f32 so, 1.8% with 7-bit weights. With VNNI or AMX int8 both are 8-bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
from tvm import relax

from partune.core.cpu import cpu_flags

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


INT8_LEVELS = 127  # the largest int8 weight magnitude
# Where a backend's int8 regions quantize (``partune.backends.Backend.int8_placement``): whole
# QDQ units, outputs too (onnxruntime runs a matmul or convolution on int8 kernels only so), or
# NNCF's placement for OpenVINO: what the matmuls and convolutions read, and attention's
# operands where they are made (``attention_sources``).
UNITS, INPUTS = "units", "inputs"
_MOVES = ("relax.reshape", "relax.permute_dims")  # carry an attention operand, values unchanged
_VNNI = bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})
INT8_ACTIVATION_LEVELS = 255 if _VNNI else 127  # an activation's u8 steps (module docstring)
# How ranges become int8 here, named in every calibration's digest: a change to it is a change to
# every int8 plan's values, which must then be measured again, not read from the store.
INT8_SCHEME = (
    f"qdq: s8 weights per channel, u8 activations in {INT8_ACTIVATION_LEVELS} steps, units v8"
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
    weight of two or more dimensions: what int8 makes faster, and what ``in_int8`` rewrites.
    Matmuls of two activations (attention's scores and context) stay f32. Quantized at the
    matmul's inputs (after the heads' reshapes and transposes), OpenVINO ran whisper's encoder
    in 13.8 ms against 11.6 ms without (AVX-512 VNNI, 1 thread), and 11.1 against 5.9 ms on
    an AVX-VNNI EPYC. NNCF quantizes them where they are made instead (the projections' bias
    adds and the softmax, before the reshapes), symmetric int8 where signed: its file runs
    4.2 ms there, 5.3-5.6 ms with those quantizers taken out. OpenVINO's regions do the same
    (``attention_sources``, ``source_output``: 4.4-4.6 ms); the matmuls themselves stay out
    of the units."""
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
    """Scale and uint8 zero point of an activation ranging over ``rng`` (zero kept exact), in
    ``INT8_ACTIVATION_LEVELS`` steps."""
    lo, hi = min(float(rng[0]), 0.0), max(float(rng[1]), 0.0)
    scale = (hi - lo) / INT8_ACTIVATION_LEVELS or 1.0
    return scale, int(np.clip(round(-lo / scale), 0, INT8_ACTIVATION_LEVELS))


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
    levels: int = INT8_LEVELS,
    unit_end: bool = True,
) -> relax.Expr:
    """``value`` (see ``quantizes``) in QDQ form: its activation quantized over ``inputs``, its
    weight per output channel into ``levels``, and, where its unit ends with it (``int8_units``),
    its output over ``output`` (``PLACEHOLDER`` for a range not given); any other value
    unchanged."""
    if not quantizes(value):
        return value
    make, fields, axis, quantize_out = _OPS[value.op.name]
    attrs = {name: getattr(value.attrs, name) for name in fields}
    x = _qdq_activation(value.args[0], inputs or PLACEHOLDER)
    y = make(x, _dq_weight(_weight(value.args[1]), axis, levels), **attrs)
    return _qdq_activation(y, output or PLACEHOLDER) if quantize_out and unit_end else y


def unit_output(value: relax.Expr, output: Range | None = None) -> relax.Expr:
    """The last value of an int8 unit longer than its op, quantized over ``output``. A ReLU's
    placeholder starts at zero, as its calibrated range does: onnxruntime drops a ReLU into the
    quantization only at a zero point of 0, and a timing must see the unit it will run."""
    relu = isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.nn.relu"
    return _qdq_activation(value, output or ((0.0, PLACEHOLDER[1]) if relu else PLACEHOLDER))


def rounding_noise(a: np.ndarray, rng: Range) -> float:
    """The power of the rounding noise ``a``, quantized over ``rng``, takes (a step squared over
    12), relative to ``a``'s mean square."""
    scale, _ = activation_qparams(rng)
    power = float(np.mean(np.square(a, dtype=np.float64)))
    return scale**2 / 12 / power if power > 0 else 0.0


def unit_noise(
    value: relax.Expr,
    x: np.ndarray,
    x_range: Range,
    y: np.ndarray | None = None,
    y_range: Range | None = None,
) -> float:
    """The noise ``in_int8`` adds to ``value`` (see ``quantizes``), relative to its power: the
    rounding noise of its activation ``x`` over ``x_range``, of its weight per output channel,
    and of its unit's output ``y`` over ``y_range`` where given. Independent noises' relative
    powers add through a product, so this is the unit's share of a plan's error up to how the
    rest of the model carries it, which varies much (on densenet the error was no sum of these):
    ``partune.search.precision`` measures the shares of the units of most noise first. It costs
    no run."""
    _, _, axis, _ = _OPS[value.op.name]
    w = _weight(value.args[1])
    assert w is not None
    axis %= w.ndim
    step = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis)) / INT8_LEVELS
    power = float(np.mean(np.square(w, dtype=np.float64)))
    noise = float(np.mean(np.square(step, dtype=np.float64))) / 12 / power if power > 0 else 0.0
    noise += rounding_noise(x, x_range)
    if y is not None and y_range is not None:
        noise += rounding_noise(y, y_range)
    return noise


def source_output(value: relax.Expr, rng: Range | None = None) -> relax.Expr:
    """An attention operand where it is made (``attention_sources``), quantized over ``rng``:
    symmetric int8 where it takes both signs (as NNCF does: on whisper's encoder OpenVINO ran
    4.4 ms so, 5.1 ms in asymmetric u8), u8 from zero where it does not (a softmax)."""
    softmax = _call_name(value) == "relax.nn.softmax"
    lo, hi = rng or ((0.0, 1.0) if softmax else PLACEHOLDER)  # a timing sees the kernel it will run
    if lo >= 0:
        return _qdq_activation(value, (0.0, hi))
    scale = relax.const(np.float32(max(-lo, hi) / INT8_LEVELS or 1.0))
    zero = relax.const(np.int8(0))
    return relax.op.dequantize(
        relax.op.quantize(value, scale, zero, axis=-1, out_dtype="int8"), scale, zero
    )


def _call_name(value: relax.Expr) -> str:
    call = isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
    return value.op.name if call else ""


def attention_sources(
    bindings: Sequence[relax.Binding], inside: Callable[[int], bool] = lambda _: True
) -> set[int]:
    """The bindings (indices) that make the operands of matmuls of two activations (attention's
    scores and context), followed back through the reshapes and transposes that carry them to
    the matmul, each the only reader of the value before it (and the matmul the only reader of
    what it makes): NNCF quantizes them there, where OpenVINO folds the quantization into the op
    that makes the value (the projection's bias add, the softmax). A value already quantized is
    left as it is."""
    return set(attention_operands(bindings, inside))


def attention_operands(
    bindings: Sequence[relax.Binding], inside: Callable[[int], bool] = lambda _: True
) -> dict[int, int]:
    """``attention_sources``, each with the matmul it feeds (its index): that matmul runs in
    int8 when its operands are quantized where they are made, so it is the unit a plan keeps in
    f32 (``Calibration.f32_units``) to leave them unquantized."""
    index = {b.var: i for i, b in enumerate(bindings)}
    readers: dict[relax.Var, int] = {}
    for b in bindings:
        for v in _reads(b.value):
            readers[v] = readers.get(v, 0) + 1
    sources: dict[int, int] = {}
    for m, b in enumerate(bindings):
        v = b.value
        if _call_name(v) != "relax.matmul" or quantizes(v) or not all(_f32(a) for a in v.args):
            continue
        if any(_weight(a) is not None for a in v.args):
            continue
        for arg in v.args:
            i = index.get(arg) if isinstance(arg, relax.Var) else None
            while i is not None and _call_name(bindings[i].value) in _MOVES:
                up = bindings[i].value.args[0]
                # Not where the operand is made: quantized after its transposes, OpenVINO ran
                # whisper's encoder in 11.1 ms, against 5.9 ms with attention in f32.
                ok = isinstance(up, relax.Var) and readers.get(up) == 1
                i = index.get(up) if ok else None
            if (
                i is not None
                and inside(i)
                and readers.get(bindings[i].var) == 1  # no other reader sees it quantized
                and _call_name(bindings[i].value) != "relax.dequantize"
            ):
                sources[i] = m
    return sources


def _reads(value: relax.Expr) -> list[relax.Var]:
    """The variables a binding's value reads (call arguments, one level of tuples)."""
    args = value.args if isinstance(value, relax.Call) else [value]
    out: list[relax.Var] = []
    for a in args:
        if isinstance(a, relax.Tuple):
            out += [f for f in a.fields if isinstance(f, relax.Var)]
        elif isinstance(a, relax.TupleGetItem) and isinstance(a.tuple_value, relax.Var):
            out.append(a.tuple_value)
        elif isinstance(a, relax.Var):
            out.append(a)
    return out


def _extends(value: relax.Expr, var: relax.Var, channels: int, rank: int) -> bool:
    """Whether ``value`` continues a convolution's unit from ``var``: a per-channel bias add (a
    constant shaped ``[1,] C, 1, ...``) or a ReLU."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
        return False
    if value.op.name == "relax.nn.relu":
        return value.args[0].same_as(var)
    if value.op.name != "relax.add" or len(value.args) != 2:
        return False
    a, b = value.args
    bias = b if a.same_as(var) else a if b.same_as(var) else None
    w = _weight(bias) if bias is not None else None
    if w is None:
        return False
    shape = w.shape[-(rank - 1) :] if w.ndim >= rank - 1 else None
    return (
        shape is not None
        and all(d == 1 for d in w.shape[: w.ndim - (rank - 1)])
        and shape[0] == channels
        and all(d == 1 for d in shape[1:])
    )


def int8_units(
    bindings: Sequence[relax.Binding],
    inside: Callable[[int], bool] = lambda _: True,
    outputs: frozenset[relax.Var] = frozenset(),
) -> dict[int, int]:
    """Per quantizable binding (its index), the binding whose value its unit's output
    quantization reads: a convolution's per-channel bias add, then a ReLU, where each is the only
    reader of the value before it, ``inside`` the region and not one of its ``outputs``; else the
    op itself. onnxruntime runs such a unit as one QLinearConv (bias inside, ReLU dropped by the
    zero point) when the quantization comes after it: a 64-channel 3x3 block ran 1.55 ms so,
    2.31 ms quantized straight after the convolution, 3.72 ms in f32."""
    readers: dict[relax.Var, list[int]] = {}
    for i, b in enumerate(bindings):
        for v in _reads(b.value):
            readers.setdefault(v, []).append(i)
    units: dict[int, int] = {}
    for i, b in enumerate(bindings):
        if not quantizes(b.value):
            continue
        end = i
        if b.value.op.name != "relax.matmul":
            ty = b.var.ty
            channels, rank = int(ty.shape[1]), len(ty.shape)
            for _ in range(2):  # a bias add, then a ReLU
                var = bindings[end].var
                after = readers.get(var, [])
                if (
                    len(after) != 1
                    or var in outputs
                    or not inside(after[0])
                    or not _extends(bindings[after[0]].value, var, channels, rank)
                ):
                    break
                end = after[0]
        units[i] = end
    return units


def unit_chain(bindings: Sequence[relax.Binding], op: int, end: int) -> list[int]:
    """The bindings of the unit from ``op`` to ``end`` (``int8_units``), in order: each reads the
    one before. A region may cut a unit anywhere along it, so each one's range is calibrated."""
    chain = [op]
    while chain[-1] != end:
        var = bindings[chain[-1]].var
        chain.append(
            next(j for j in range(chain[-1] + 1, end + 1) if var in _reads(bindings[j].value))
        )
    return chain


@relax.expr_functor.mutator
class _Int8Mutator(relax.PyExprMutator):
    def __init__(
        self, func: relax.Function, ranges: Mapping[str, Range], levels: int, placement: str
    ) -> None:
        super().__init__()
        self.ranges, self.levels, self.outputs = ranges, levels, placement == UNITS
        bindings = [b for block in func.body.blocks for b in block.bindings]
        outputs = frozenset(_reads(func.body.body)) | frozenset(
            [func.body.body] if isinstance(func.body.body, relax.Var) else []
        )
        units = int8_units(bindings, outputs=outputs)
        self.ops = {bindings[i].var: bindings[e].var for i, e in units.items()}
        ends = {e for op, e in self.ops.items() if not e.same_as(op)}
        self.ends = ends if self.outputs else set()
        sources = attention_sources(bindings) if placement == INPUTS else set()
        self.sources = {bindings[i].var for i in sources}

    def _range(self, var: relax.Expr) -> Range | None:
        return self.ranges.get(var.name) if isinstance(var, relax.Var) else None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        var = binding.var
        if var in self.ops and quantizes(value):
            end = self.ops[var]
            value = in_int8(
                value,
                self._range(value.args[0]),
                self._range(var),
                self.levels,
                self.outputs and end.same_as(var),
            )
        elif var in self.ends:
            value = unit_output(value, self._range(var))
        elif var not in self.sources:
            return super().visit_var_binding_(binding)
        if var in self.sources:
            value = source_output(value, self._range(var))
        dataflow = isinstance(var, relax.DataflowVar)
        emit = self.builder_.emit if dataflow else self.builder_.emit_output
        self.set_var_remap(var, emit(value, name_hint=var.name))
        return None


def function_in_int8(
    func: relax.Function,
    ranges: Mapping[str, Range] | None = None,
    levels: int = INT8_LEVELS,
    placement: str = UNITS,
) -> relax.Function:
    """Every matmul and convolution of ``func`` that ``quantizes`` in QDQ form, in units
    (``int8_units``); ``ranges`` by variable name (the activation read, the unit's last value,
    an attention operand), placeholders elsewhere. ``placement`` ``INPUTS``: the activations the
    ops read and attention's operands where they are made, not the units' outputs."""
    return _Int8Mutator(func, ranges or {}, levels, placement).visit_expr(func)


def quantize_int8(
    ranges: Mapping[str, Range] | None = None, levels: int = INT8_LEVELS, placement: str = UNITS
):
    """``function_in_int8`` as a named TVM pass over every Relax function of a module."""

    @relax.transform.function_pass(opt_level=0, name="QuantizeInt8")
    def transform(
        func: relax.Function, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext
    ) -> relax.Function:
        return function_in_int8(func, ranges, levels, placement)

    return transform
