"""Translators of the neural-network Relax ops: matmul, convolution, pooling, normalisation,
softmax and padding.

Layouts and attributes are checked, never guessed: what ONNX cannot compute as TVM does
is refused. One of the op families whose tables ``onnx_ops`` joins.
"""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from partune.backends.base import BackendError
from partune.backends.onnx_graph import (
    OnnxGraph,
    Translator,
    Value,
    arg_dtype,
    int_list,
    norm_axis,
    op_name,
    registrar,
    tensor_dtype,
    tensor_shape,
)

TRANSLATORS: dict[str, Translator] = {}
_register = registrar(TRANSLATORS)


@_register("relax.nn.softmax", "relax.nn.log_softmax")
def _softmax(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    op = "Softmax" if op_name(call) == "relax.nn.softmax" else "LogSoftmax"
    return g.node(op, [g.tensor(call.args[0])], axis=int(call.attrs.axis))


@_register("relax.matmul")
def _matmul(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    out = tensor_dtype(ty)
    a = g.cast(g.tensor(call.args[0]), arg_dtype(call, 0), out)
    b = g.cast(g.tensor(call.args[1]), arg_dtype(call, 1), out)
    return g.node("MatMul", [a, b])


def _check_layouts(attrs: Any, want: dict[str, str]) -> None:
    for field, layout in want.items():
        got = str(getattr(attrs, field))
        if got not in (layout, ""):
            raise BackendError(f"{field} {got} not supported (only {layout})")


# Relax convolution op -> (data layout, kernel layout) ONNX Conv / ConvTranspose compute.
_CONV_LAYOUTS: dict[str, tuple[str, str]] = {
    "relax.nn.conv1d": ("NCW", "OIW"),
    "relax.nn.conv2d": ("NCHW", "OIHW"),
    "relax.nn.conv3d": ("NCDHW", "OIDHW"),
}
_CONV_TRANSPOSE_LAYOUTS: dict[str, tuple[str, str]] = {
    "relax.nn.conv1d_transpose": ("NCW", "IOW"),
    "relax.nn.conv2d_transpose": ("NCHW", "IOHW"),
}


def _conv_operands(
    g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type, layouts: tuple[str, str]
) -> tuple[list[str], dict[str, Any]]:
    """Checked layouts; (data, weight) cast to the output dtype; the attributes Conv and
    ConvTranspose share. Relax pads are (begins..., ends...), as ONNX ``pads`` are."""
    a = call.attrs
    data, kernel = layouts
    _check_layouts(a, {"data_layout": data, "kernel_layout": kernel, "out_layout": data})
    out = tensor_dtype(ty)
    x = g.cast(g.tensor(call.args[0]), arg_dtype(call, 0), out)
    w = g.cast(g.tensor(call.args[1]), arg_dtype(call, 1), out)
    attrs = {
        "kernel_shape": list(tensor_shape(call.args[1].ty)[2:]),
        "strides": int_list(a.strides),
        "pads": int_list(a.padding),
        "dilations": int_list(a.dilation),
        "group": int(a.groups),
    }
    return [x, w], attrs


@_register(*_CONV_LAYOUTS)
def _conv(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """conv1d/2d/3d as one Conv node: a graph runtime's conv kernels and Conv+activation
    fusions see the op itself (an untranslated conv1d would run on the fallback backend)."""
    inputs, attrs = _conv_operands(g, call, ty, _CONV_LAYOUTS[op_name(call)])
    return g.node("Conv", inputs, **attrs)


@_register(*_CONV_TRANSPOSE_LAYOUTS)
def _conv_transpose(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Transposed convolution; the same output size formula as ONNX with explicit pads and
    output_padding (strict shape inference checks it against the Relax type)."""
    inputs, attrs = _conv_operands(g, call, ty, _CONV_TRANSPOSE_LAYOUTS[op_name(call)])
    return g.node(
        "ConvTranspose", inputs, output_padding=int_list(call.attrs.output_padding), **attrs
    )


def _pool_common(a: Any) -> dict[str, Any]:
    _check_layouts(a, {"layout": "NCHW", "out_layout": "NCHW"})
    return {
        "kernel_shape": int_list(a.pool_size),
        "strides": int_list(a.strides),
        "pads": int_list(a.padding),
        "ceil_mode": int(bool(a.ceil_mode)),
    }


@_register("relax.nn.max_pool2d")
def _max_pool2d(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    return g.node(
        "MaxPool", [g.tensor(call.args[0])], dilations=int_list(a.dilation), **_pool_common(a)
    )


@_register("relax.nn.avg_pool2d")
def _avg_pool2d(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    attrs = _pool_common(a)
    if any(d != 1 for d in int_list(a.dilation)):
        if g.opset < 19:
            raise BackendError("dilated average pooling needs opset 19")
        attrs["dilations"] = int_list(a.dilation)
    return g.node(
        "AveragePool",
        [g.tensor(call.args[0])],
        count_include_pad=int(bool(a.count_include_pad)),
        **attrs,
    )


@_register("relax.nn.adaptive_avg_pool2d")
def _adaptive_avg_pool2d(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Static shapes: 1x1 is a global pool, an exact divisor is a plain average pool."""
    _check_layouts(call.attrs, {"layout": "NCHW", "out_layout": "NCHW"})
    x = g.tensor(call.args[0])
    in_hw, out_hw = tensor_shape(call.args[0].ty)[2:], tensor_shape(ty)[2:]
    if in_hw == out_hw:
        return g.node("Identity", [x])
    if out_hw == (1, 1):
        return g.node("GlobalAveragePool", [x])
    if any(i % o for i, o in zip(in_hw, out_hw, strict=True)):
        raise BackendError("adaptive pooling with uneven windows")
    k = [i // o for i, o in zip(in_hw, out_hw, strict=True)]
    return g.node("AveragePool", [x], kernel_shape=k, strides=k)


def _require_affine(attrs: Any) -> None:
    """TVM's lowering ignores center=False / scale=False (always applies beta and gamma),
    while the op's documentation says they are skipped: refuse rather than pick one."""
    if not (bool(attrs.center) and bool(attrs.scale)):
        raise BackendError("normalisation with center/scale disabled is ambiguous in TVM")


@_register("relax.nn.batch_norm")
def _batch_norm(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    """Inference batch norm; the tuple's mean/var fields are the moving statistics."""
    a = call.attrs
    if bool(a.training):
        raise BackendError("training-mode batch_norm")
    x, gamma, beta, mean, var = (g.tensor(v) for v in call.args)
    shape = tensor_shape(call.args[0].ty)
    if len(shape) < 2 or norm_axis(int(a.axis), len(shape)) != 1:
        raise BackendError("batch_norm only on axis 1")
    _require_affine(a)
    out = g.node("BatchNormalization", [x, gamma, beta, mean, var], epsilon=float(a.epsilon))
    return [out, mean, var]


@_register("relax.nn.layer_norm")
def _layer_norm(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    ndim = len(tensor_shape(call.args[0].ty))
    axes = sorted(norm_axis(int(ax), ndim) for ax in a.axes)
    if axes != list(range(ndim - len(axes), ndim)) or not axes:
        raise BackendError("layer_norm only over trailing axes")
    _require_affine(a)
    inputs = [g.tensor(v) for v in call.args]
    return g.node("LayerNormalization", inputs, axis=axes[0], epsilon=float(a.epsilon))


@_register("relax.nn.pad")
def _pad(g: OnnxGraph, call: relax.Call, ty: tvm.ir.Type) -> Value:
    a = call.attrs
    widths = int_list(a.pad_width)
    if any(w < 0 for w in widths):
        raise BackendError("negative padding")
    mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}.get(str(a.pad_mode))
    if mode is None:
        raise BackendError(f"pad mode {a.pad_mode} not supported")
    if not any(widths):
        # A no-op (the importer emits these before every conv). Emitting it as Pad also
        # trips an ORT optimiser bug (Pad+Conv+BatchNorm fusion drops a tensor that the
        # graph still reads), so pass the input through.
        return g.tensor(call.args[0])
    pads = widths[0::2] + widths[1::2]  # Relax interleaves (before, after); ONNX wants begins, ends
    inputs = [g.tensor(call.args[0]), g.int64s(pads)]
    if mode == "constant":
        inputs.append(g.scalar(float(a.pad_value), tensor_dtype(ty)))
    return g.node("Pad", inputs, mode=mode)
