"""Relax to ONNX: a static-shape Relax function becomes one checked ONNX model.

Translating a whole region into one graph (rather than running it op by op) lets a graph
runtime's own optimisations apply: constant folding, Conv+BN+Add+activation fusion, GELU
and LayerNorm fusion, layout transformation. The translation is a pure function of the
Relax function (``relax_to_onnx``); every emitted value is checked against the Relax type
by ONNX strict shape inference, so a translator that gets a shape or dtype wrong fails
loudly at build time instead of computing garbage.

The exporter is apart from any backend because several use it: the onnxruntime and
OpenVINO backends compile its output, and the peers translate whole models with it. The
per-op translators are in ``onnx_ops``, the graph builder in ``onnx_graph``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import tvm
from onnx import helper
from tvm import relax

from partune.backends.base import BackendError
from partune.backends.onnx_graph import (
    ONNX_DTYPES,
    OnnxGraph,
    Value,
    flat_names,
    flat_types,
    is_tensor_const,
    tensor_dtype,
    tensor_shape,
)
from partune.backends.onnx_idioms import fuse_idioms
from partune.backends.onnx_ops import TRANSLATORS

MIN_OPSET = 17  # LayerNormalization
# Called after each binding of the translated function's own body: (binding index, binding,
# the graph, the index of the first ONNX node it made). ``partune.partition_onnx`` uses it to
# label every ONNX node with the binding, and so the plan region, it came from.
BindingHook = Callable[[int, relax.VarBinding, OnnxGraph, int], None]


def translate_value(g: OnnxGraph, value: Any, ty: tvm.ir.Type) -> Value:
    """The ONNX value of one binding's right-hand side."""
    if isinstance(value, relax.Call):
        if isinstance(value.op, relax.Function):
            return _inline(g, value.op, [g.value(a) for a in value.args])
        if isinstance(value.op, relax.Var) and isinstance(g.env.get(value.op), relax.Function):
            return _inline(g, g.env[value.op], [g.value(a) for a in value.args])
        if not isinstance(value.op, tvm.ir.Op):
            raise BackendError(f"call to {type(value.op).__name__} not supported")
        fn = TRANSLATORS.get(value.op.name)
        if fn is None:
            raise BackendError(f"op {value.op.name} not supported")
        for t in flat_types(ty):
            tensor_dtype(t)
        try:
            return fn(g, value, ty)
        except (AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
            raise BackendError(f"{value.op.name}: cannot translate ({e})") from e
    if isinstance(value, relax.Var | relax.Tuple | relax.TupleGetItem) or is_tensor_const(value):
        return g.value(value)
    raise BackendError(f"binding of {type(value).__name__} not supported")


def _translate_body(g: OnnxGraph, body: Any, on_binding: BindingHook | None = None) -> Value:
    if not isinstance(body, relax.SeqExpr):
        return g.value(body)
    index = -1  # the binding's position in the body (``DataflowGraph`` node index for main)
    for block in body.blocks:
        for binding in block.bindings:
            index += 1
            if not isinstance(binding, relax.VarBinding):
                raise BackendError(f"{type(binding).__name__} not supported")
            if isinstance(binding.value, relax.Function):
                g.env[binding.var] = binding.value  # inlined at its call sites
                continue
            g.hint = binding.var.name
            start = len(g.nodes)
            g.bind(binding.var, translate_value(g, binding.value, binding.var.ty))
            if on_binding is not None:
                on_binding(index, binding, g, start)
    return g.value(body.body)


def _inline(g: OnnxGraph, func: relax.Function, args: list[Value]) -> Value:
    """Inline a local (e.g. composite) function: bind its params to the argument values."""
    for param, arg in zip(func.params, args, strict=True):
        g.env[param] = arg
    return _translate_body(g, func.body)


def _make_model(g: OnnxGraph, outputs: list[str], out_types: list[tvm.ir.Type]) -> onnx.ModelProto:
    """Close the graph: an Identity per output gives distinct names even for aliases."""
    out_infos = []
    for i, (name, ty) in enumerate(zip(outputs, out_types, strict=True)):
        out_name = g.fresh(f"out{i}")
        g.nodes.append(helper.make_node("Identity", [name], [out_name]))
        out_infos.append(
            helper.make_tensor_value_info(out_name, ONNX_DTYPES[tensor_dtype(ty)], tensor_shape(ty))
        )
    graph = helper.make_graph(g.nodes, "partune_region", g.inputs, out_infos, g.initializers)
    opset = helper.make_opsetid("", g.opset)
    model = helper.make_model(graph, opset_imports=[opset], producer_name="partune")
    model.ir_version = helper.find_min_ir_version_for([opset])
    return model


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its large initializers turned into typed inputs.

    The checker and shape inference need types, not weights; serialising 100 MB of weights
    twice would dominate the build. Small initializers (shapes, axes) stay for data propagation.
    """
    g = model.graph
    big = [t for t in g.initializer if int(np.prod(t.dims)) > 64]
    if not big:
        return model
    names = {t.name for t in big}
    inputs = [*g.input, *(helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in big)]
    small = [t for t in g.initializer if t.name not in names]
    graph = helper.make_graph(g.node, g.name, inputs, g.output, small)
    out = helper.make_model(
        graph, opset_imports=model.opset_import, producer_name=model.producer_name
    )
    out.ir_version = model.ir_version
    return out


def _check_types(model: onnx.ModelProto, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """onnx.checker must pass and strict shape inference must reproduce every Relax type."""
    skeleton = _skeleton(model)
    try:
        onnx.checker.check_model(skeleton)
        inferred = onnx.shape_inference.infer_shapes(
            skeleton, check_type=True, strict_mode=True, data_prop=True
        )
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise BackendError(f"invalid ONNX graph: {e}") from e
    g = inferred.graph
    for info in [*g.value_info, *g.output, *g.input]:
        want = expected.get(info.name)
        if want is None or not info.type.HasField("tensor_type"):
            continue
        tt = info.type.tensor_type
        if tt.elem_type != ONNX_DTYPES[want[0]]:
            raise BackendError(f"{info.name}: ONNX dtype {tt.elem_type}, Relax says {want[0]}")
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if None not in dims and tuple(dims) != want[1]:
                raise BackendError(f"{info.name}: ONNX shape {dims}, Relax says {list(want[1])}")


def build_onnx(
    g: OnnxGraph, result: Value, ret_ty: tvm.ir.Type, fuse: bool = True
) -> onnx.ModelProto:
    outputs, out_types = flat_names(result), flat_types(ret_ty)
    if len(outputs) != len(out_types):
        raise BackendError("result does not match the return type")
    shapes = {name: shape for name, (_, shape) in g.expected.items()}
    shapes |= {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in g.inputs}
    ranks = {name: len(shape) for name, shape in shapes.items()}
    model = _make_model(g, outputs, out_types)
    if fuse:
        model = fuse_idioms(model, ranks, shapes)
    _check_types(model, g.expected)
    return model


def relax_to_onnx(
    func: relax.Function, opset: int = MIN_OPSET, on_binding: BindingHook | None = None
) -> onnx.ModelProto:
    """Translate a static-shape Relax function into one checked ONNX model.

    Tensor params become graph inputs (in order), ``relax.Constant`` weights become
    initializers, and the returned tensor or (nested) tuple becomes the graph outputs,
    flattened in order. Raises ``BackendError`` on anything it cannot translate exactly.
    With ``on_binding`` (``BindingHook``) the idiom fusion is left out, so that every ONNX
    node stays the work of one binding (a fused HardSwish may span several).
    """
    if opset < MIN_OPSET:
        raise BackendError(f"opset {opset} < {MIN_OPSET}")
    g = OnnxGraph(opset)
    for param in func.params:
        g.env[param] = g.add_input(param.name, param.ty)
    result = _translate_body(g, func.body, on_binding)
    ret_ty = func.body.body.ty if isinstance(func.body, relax.SeqExpr) else func.ret_ty
    return build_onnx(g, result, ret_ty, fuse=on_binding is None)
