"""OpenVINO backend: a region becomes one OpenVINO model compiled by the CPU plugin.

The region goes through the same ONNX translation as the ONNX Runtime backend
(``relax_to_onnx``, checked against the Relax types), then OpenVINO reads the ONNX bytes
and compiles them with its own graph transformations and JIT kernels (oneDNN convolutions
and matmuls, fused eltwise chains, its own LayerNorm/MHA fusions). That is a different
optimiser from ORT's, so the two compete for the same regions.

Precision is pinned: on AMX / AVX512-BF16 CPUs the plugin's default inference precision is
bf16, which silently changes results, and its PERFORMANCE mode enables dynamic quantisation.
Every compiled model is ACCURACY mode, one stream, the thread count it is given, and f32
unless its SEScope asks for bf16 (then the plugin's bf16 inference precision: matmuls,
convolutions and most eltwise ops in bfloat16, on the CPU's bf16 instructions).

``accepts`` never guesses. The CPU plugin does not compute every dtype as asked (measured on
OpenVINO 2026.4 against TVM): int64 and uint64 are narrowed to 32 bits even through a
reshape, float64 runs in float32, uint32 reductions and casts go wrong, integer arithmetic
saturates (int8 127 + 1 = 127) and integer reductions run in float32 (max of INT32_MAX gives
INT32_MIN), and float-to-bool makes NaN false. So a binding is refused unless its dtypes are
used only where the plugin is exact (see ``_dtype_refusal``); then it must pass the ONNX
translation probe (``binding_accepted``) and OpenVINO must compile it as a one-op model
(cached per op signature).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import tvm
from tvm import relax

from partune.backends import build_cache
from partune.backends.base import BackendError
from partune.backends.kernel import BoundKernel, Spec
from partune.backends.onnx_graph_backend import (
    OnnxGraphBackend,
    binding_key,
    load_specs,
    probe_once,
    save_specs,
)
from partune.backends.onnxruntime_backend import binding_accepted
from partune.backends.relax_onnx import MIN_OPSET, relax_to_onnx
from partune.core import static_shape, tensor_types

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------------------------
# Where each dtype is exact in the CPU plugin

_NEVER = frozenset({"float64", "uint32", "uint64"})  # computed in another precision
_SMALL_INTS = frozenset({"int8", "uint8", "int16", "uint16"})  # every value exact in f32
_INTS = _SMALL_INTS | {"int32", "int64"}
_TRUTHY = _SMALL_INTS | {"bool"}  # nonzero -> true is exact (no NaN, no narrowing)
_MOVE = frozenset(
    {
        "relax.reshape",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.flatten",
        "relax.permute_dims",
        "relax.broadcast_to",
        "relax.concat",
        "relax.split",
        "relax.strided_slice",
        "relax.take",
        "relax.index_tensor",
        "relax.gather_elements",
        "relax.where",
        "relax.full",
        "relax.full_like",
        "relax.zeros",
        "relax.zeros_like",
        "relax.ones",
        "relax.ones_like",
        "relax.arange",
    }
)
_COMPARE = frozenset(
    {
        "relax.equal",
        "relax.not_equal",
        "relax.less",
        "relax.less_equal",
        "relax.greater",
        "relax.greater_equal",
        "relax.maximum",
        "relax.minimum",
        "relax.clip",
    }
)
_INT_SAFE = _MOVE | _COMPARE | {"relax.astype"}  # value-preserving: no overflow, no rounding
_REDUCE_SMALL = frozenset({"relax.max", "relax.min"})  # run in f32: exact for small ints only
_LOGICAL = frozenset(
    {"relax.logical_and", "relax.logical_or", "relax.logical_xor", "relax.logical_not"}
)


def _dtypes(ty: Any) -> list[str]:
    if isinstance(ty, relax.TupleType):
        return [d for f in ty.fields for d in _dtypes(f)]
    if isinstance(ty, relax.TensorType):
        return [str(ty.dtype)]
    return []


def _arg_dtypes(expr: Any) -> list[str]:
    return _dtypes(getattr(expr, "ty", None))


def _dtype_refusal(binding: relax.Binding) -> str | None:
    """Why the CPU plugin would not compute this binding exactly (None: it would)."""
    value = binding.value
    outs = _dtypes(binding.var.ty)
    if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
        return "call to a function"
    if not isinstance(value, relax.Call):
        # Structural bindings compute nothing, but their values become region I/O.
        bad = set(outs) & (_NEVER | {"int64"})
        return f"{sorted(bad)} tensors" if bad else None
    op = value.op.name
    args = [_arg_dtypes(a) for a in value.args]
    every = set(outs).union(*args)
    if every & _NEVER:
        return f"{sorted(every & _NEVER)} tensors"
    if "int64" in outs:
        return "int64 result (narrowed to int32)"
    # int64 may only be read where its narrowing to int32 is harmless: as the source of
    # astype (the plugin's narrowing wraps, as Relax's cast does) or as gather indices
    # (any in-bounds index fits in int32).
    index_arg = 1 if op in ("relax.take", "relax.index_tensor", "relax.gather_elements") else -1
    data = set(outs).union(*(a for i, a in enumerate(args) if i != index_arg))
    if op != "relax.astype" and "int64" in data:
        return "int64 operand (narrowed to int32)"
    ints = data & _INTS
    if ints and op not in _INT_SAFE | _REDUCE_SMALL:
        return f"{op} on {sorted(ints)} (integer arithmetic saturates or runs in f32)"
    if op in _REDUCE_SMALL and ints - _SMALL_INTS:
        return f"{op} on {sorted(ints - _SMALL_INTS)} (reduced in f32)"
    truth = [args[0]] if op == "relax.where" else args if op in _LOGICAL else []
    if op == "relax.astype" and outs == ["bool"]:
        truth = [args[0]]
    falsy = {d for a in truth for d in a} - _TRUTHY
    if falsy:
        return f"truth value of {sorted(falsy)} (NaN or wide ints convert wrongly)"
    return None


# ---------------------------------------------------------------------------------------
# OpenVINO runtime: one Core per process, one config for every compiled model

_core_lock = threading.Lock()
_core_box: dict[str, Any] = {}


def openvino_core() -> Any:
    """The process's ``openvino.Core`` (reading plugins is slow; a Core is thread-safe)."""
    with _core_lock:
        if "core" not in _core_box:
            import openvino as ov

            _core_box["core"] = ov.Core()
        return _core_box["core"]


def compile_config(threads: int, precision: str = "f32") -> dict[Any, Any]:
    """``precision`` (f32 unless asked), one stream and ``threads`` threads, nothing pinned or
    value-dependent."""
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hint
    import openvino.properties.intel_cpu as cpu

    return {
        # The plugin's default is bf16 on AMX CPUs: f32 unless the scope says bf16.
        hint.inference_precision(): ov.Type.bf16 if precision == "bf16" else ov.Type.f32,
        hint.execution_mode(): hint.ExecutionMode.ACCURACY,  # also: no dynamic quantisation
        hint.performance_mode(): hint.PerformanceMode.LATENCY,
        props.inference_num_threads(): max(1, int(threads)),
        props.num_streams(): 1,
        hint.enable_cpu_pinning(): False,  # pinning would pin the caller's thread too
        hint.enable_hyper_threading(): False,
        hint.dynamic_quantization_group_size(): 0,
        cpu.tbb_partitioner(): cpu.TbbPartitioner.STATIC,  # same work split on every run
    }


def compile_onnx(model: onnx.ModelProto, threads: int, precision: str = "f32") -> Any:
    """Read the ONNX model and compile it for the CPU plugin; BackendError if it cannot."""
    core = openvino_core()
    try:
        ov_model = core.read_model(model.SerializeToString())
        return core.compile_model(ov_model, "CPU", compile_config(threads, precision))
    except Exception as e:  # OpenVINO raises RuntimeError / OpConversionFailure / ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BackendError(f"openvino could not compile the region: {first[:300]}") from e


# ---------------------------------------------------------------------------------------
# accepts(): dtype policy, then the ONNX probe, then an OpenVINO compile of the one op


_ACCEPT_CACHE: dict[tuple, bool] = {}
_ACCEPT_LOCK = threading.Lock()


def _leaf_params(var: relax.Var, ty: Any, params: list[relax.Var]) -> relax.Expr:
    """Fresh tensor parameters for ``var``'s value; a tuple becomes a Tuple of them."""
    if isinstance(ty, relax.TupleType):
        return relax.Tuple([_leaf_params(var, f, params) for f in ty.fields])
    if not isinstance(ty, relax.TensorType):
        raise BackendError(f"free variable {var.name} of type {ty}")
    params.append(relax.Var(f"{var.name}_{len(params)}", ty))
    return params[-1]


_PROBE_CONST_LIMIT = 64  # larger weights become probe inputs (ORT's probe does the same)


def _lift_consts(expr: Any, params: list[relax.Var]) -> Any:
    """``expr`` with large tensor constants replaced by fresh parameters of the same type."""
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_lift_consts(f, params) for f in expr.fields])
    ty = getattr(expr, "ty", None)
    if (
        isinstance(expr, tvm.ir.GenericConst)
        and isinstance(ty, relax.TensorType)
        and int(np.prod([int(d) for d in ty.shape.values])) > _PROBE_CONST_LIMIT
    ):
        params.append(relax.Var(f"w{len(params)}", ty))
        return params[-1]
    return expr


def one_binding_function(binding: relax.Binding) -> relax.Function:
    """The binding as a function of its free variables (rebound from fresh parameters).

    Large weights become parameters too: a probe needs their types, not 100 MB of values.
    """
    if not isinstance(binding, relax.VarBinding):
        raise BackendError("not a VarBinding")
    params: list[relax.Var] = []
    rebinds = [
        relax.VarBinding(v, _leaf_params(v, v.ty, params))
        for v in relax.analysis.free_vars(binding.value)
    ]
    value = binding.value
    if isinstance(value, relax.Call):
        args = [_lift_consts(a, params) for a in value.args]
        value = relax.Call(value.op, args, value.attrs, value.ty_args, ret_ty=value.ty)
    body = relax.SeqExpr(
        [relax.BindingBlock([*rebinds, relax.VarBinding(binding.var, value)])], binding.var
    )
    return relax.Function(params, body, binding.var.ty)


def _probe(binding: relax.Binding, opset: int) -> None:
    compile_onnx(relax_to_onnx(one_binding_function(binding), opset), threads=1)


def ov_accepts(binding: relax.Binding, opset: int = MIN_OPSET) -> bool:
    """Whether OpenVINO computes this binding exactly (dtype policy, translation, compile)."""
    try:
        if _dtype_refusal(binding) is not None:
            return False
        key = (opset, binding_key(binding))
    except Exception:  # an unprintable or malformed binding is simply refused
        return False
    if not binding_accepted(binding, opset):
        return False
    value = binding.value
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
        return True  # structural: translates to no OpenVINO op at all
    # Any failure (translation, OpenVINO frontend or plugin) means refuse.
    return probe_once(_ACCEPT_CACHE, _ACCEPT_LOCK, key, lambda: _probe(binding, opset))


# ---------------------------------------------------------------------------------------
# The kernel: infer requests bound to the caller's buffers


def _raw_array(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A NumPy array over caller memory that does not keep that memory alive.

    Holding the TVM tensors would stop the VM's pooled allocator from reusing their
    storage, so every run would see new addresses and rebind; like ORT's binding by
    pointer, a binding only ever runs while the caller's buffers at those addresses live.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)


def ov_specs(model: onnx.ModelProto, func: relax.Function) -> tuple[list[Spec], list[Spec]]:
    """(name, dtype, shape) of the inputs and outputs: ONNX names, the Relax types' dtypes."""
    in_types = [p.ty for p in func.params]
    out_types = tensor_types(
        func.body.body.ty if isinstance(func.body, relax.SeqExpr) else func.ret_ty
    )
    return (
        [
            (i.name, _np_dtype(t), static_shape(t))
            for i, t in zip(model.graph.input, in_types, strict=True)
        ],
        [
            (o.name, _np_dtype(t), static_shape(t))
            for o, t in zip(model.graph.output, out_types, strict=True)
        ],
    )


class OvRegionKernel(BoundKernel):
    """A built region: each set of buffers gets its own infer request whose input and output
    tensors wrap the caller's memory (OpenVINO reads the inputs and writes the results in
    place); see ``BoundKernel``.
    """

    def __init__(self, compiled: Any, ins: list[Spec], outs: list[Spec]) -> None:
        super().__init__(ins, outs)
        self.compiled = compiled
        # OpenVINO drops unused inputs and may merge names: find ports by tensor name.
        self._in_port = [_port(compiled.inputs, name, required=False) for name, _, _ in self._in]
        self._out_port = [_port(compiled.outputs, name, required=True) for name, _, _ in self._out]

    def bind_zero_copy(
        self, args: Sequence[Any], ins: list[np.ndarray], outs: list[np.ndarray]
    ) -> Callable[[], Any]:
        """Set every input and output tensor to wrap caller memory; the cheapest way to run."""
        import openvino as ov

        request = self.compiled.create_infer_request()
        ins, outs = _raw(ins), _raw(outs)
        for arr, port in zip(ins, self._in_port, strict=True):
            if port is not None:
                request.set_input_tensor(port, ov.Tensor(arr, shared_memory=True))
        for arr, port in zip(outs, self._out_port, strict=True):
            request.set_output_tensor(port, ov.Tensor(arr, shared_memory=True))
        for arr, port in zip(ins, self._in_port, strict=True):
            if port is not None and not _shares(request.get_input_tensor(port), arr):
                raise RuntimeError("input tensor was copied")
        for arr, port in zip(outs, self._out_port, strict=True):
            if not _shares(request.get_output_tensor(port), arr):
                raise RuntimeError("output tensor was copied")
        return _infer_call(request)

    def bind_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], Any]:
        request = self.compiled.create_infer_request()
        return functools.partial(self._run_copying, request, _raw(ins), _raw(outs))

    def _run_copying(self, request: Any, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
        for arr, port in zip(ins, self._in_port, strict=True):
            if port is not None:
                np.copyto(request.get_input_tensor(port).data, arr)
        _infer_call(request)()
        for arr, port in zip(outs, self._out_port, strict=True):
            np.copyto(arr, request.get_output_tensor(port).data)


def _raw(views: list[np.ndarray]) -> list[np.ndarray]:
    """Views of the caller's memory that hold no reference to its TVM tensors (see _raw_array)."""
    return [_raw_array(v.ctypes.data, v.dtype, v.shape) for v in views]


def _np_dtype(ty: Any) -> np.dtype:
    return np.dtype(str(ty.dtype))


def _port(ports: Sequence[Any], name: str, required: bool) -> int | None:
    for i, port in enumerate(ports):
        if name in port.get_names():
            return i
    if required:
        raise BackendError(f"openvino lost the output {name}")
    return None


def _infer_call(request: Any) -> Callable[[], Any]:
    """The C++ infer: skips the Python wrapper's input dispatch and its output dict copies."""
    from openvino import _pyopenvino

    base = getattr(_pyopenvino.InferRequest, "infer", None)
    if base is not None and "share_outputs: bool, decode_strings: bool" in (base.__doc__ or ""):
        return functools.partial(base, request, {}, True, False)
    return functools.partial(request.infer, None, True, True)


def _shares(tensor: Any, arr: np.ndarray) -> bool:
    return arr.size == 0 or tensor.data.ctypes.data == arr.ctypes.data


_OV_BLOB = "compiled.blob"


class OpenVinoBackend(OnnxGraphBackend):
    """OpenVINO on CPU: graph-level, takes any convex region as one compiled model."""

    name = "openvino"
    bf16 = True
    # A 768x3072 FFN (128 tokens, 1 thread, AVX-512 VNNI) ran 1.70-1.79 ms with its matmuls'
    # inputs quantized, 1.91-2.00 ms with their outputs too (onnxruntime: 2.3-2.5 ms with them,
    # 10.4-11.1 ms without); whisper's encoder 4.4 ms with attention quantized at its sources,
    # 5.9 ms without.
    int8_placement = "inputs"

    def __init__(self, opset: int = MIN_OPSET) -> None:
        super().__init__(opset)
        self.threads = 1

    def accepts(self, binding: relax.Binding) -> bool:
        return ov_accepts(binding, self.opset)

    def kernel(
        self, model: onnx.ModelProto, func: relax.Function, threads: int, precision: str = "f32"
    ) -> OvRegionKernel:
        """Compile for the CPU plugin; a build worker stores the compiled blob
        (``export_model``)."""
        compiled = compile_onnx(model, threads, precision)
        kernel = OvRegionKernel(compiled, *ov_specs(model, func))
        entry = build_cache.current()
        if entry is not None:

            def write(d: str) -> None:
                blob = compiled.export_model()
                with open(os.path.join(d, _OV_BLOB), "wb") as f:
                    f.write(blob.getvalue() if hasattr(blob, "getvalue") else bytes(blob))
                save_specs(d, kernel)

            entry.store(write)
        return kernel

    def load_kernel(self, directory: str, threads: int, precision: str = "f32") -> OvRegionKernel:
        """Import a blob ``kernel`` exported (OpenVINO checks it was made by this version)."""
        with open(os.path.join(directory, _OV_BLOB), "rb") as f:
            blob = f.read()
        compiled = openvino_core().import_model(blob, "CPU", compile_config(threads, precision))
        return OvRegionKernel(compiled, *load_specs(directory))

    def library_version(self) -> str:
        import openvino as ov

        return ov.get_version()

    def set_threads(self, threads: int) -> None:
        """Threads are per compiled model (``build_region``); the Core default follows too."""
        import openvino.properties as props

        self.threads = max(1, int(threads))
        openvino_core().set_property("CPU", {props.inference_num_threads(): self.threads})
