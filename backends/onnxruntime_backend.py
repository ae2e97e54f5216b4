"""ONNX Runtime backend: a region becomes one ONNX graph run by one InferenceSession.

Translating a whole region into one graph (rather than calling ORT op by op) lets ORT's
own graph optimisations apply: constant folding, Conv+BN+Add+activation fusion, GELU and
LayerNorm fusion, NCHWc layout transformation. The translation itself, checked against
the Relax types, is ``partune.backends.relax_onnx`` (shared with OpenVINO and the
peers); the base class both graph backends share is ``onnx_graph_backend``. This module
holds what is ORT's: the acceptance probe, sessions, the region kernel and the backend.

``accepts`` never guesses: it translates the single binding into a one-node graph and
creates an ORT session for it (cached per op signature), so an attribute, layout or dtype
ORT has no kernel for is refused, not discovered later.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import tvm
from onnx import helper
from tvm import relax

from partune.backends import build_cache
from partune.backends.base import BackendError
from partune.backends.kernel import BoundKernel, Spec
from partune.backends.onnx_graph import OnnxGraph, Value
from partune.backends.onnx_graph_backend import (
    OnnxGraphBackend,
    binding_key,
    load_specs,
    probe_once,
    save_specs,
)
from partune.backends.relax_onnx import MIN_OPSET, build_onnx, translate_value

# ---------------------------------------------------------------------------------------
# accepts(): translate one binding, create a session for it, cache per signature


_ACCEPT_CACHE: dict[tuple, bool] = {}
_ACCEPT_LOCK = threading.Lock()


def _placeholder(g: OnnxGraph, ty: tvm.ir.Type) -> Value:
    if isinstance(ty, relax.TupleType):
        return [_placeholder(g, f) for f in ty.fields]
    return g.add_input("x", ty)


def _probe(binding: relax.Binding, opset: int) -> None:
    """Translate one binding into a one-op model and let ORT resolve its kernels."""
    import onnxruntime as ort

    if not isinstance(binding, relax.VarBinding):
        raise BackendError("not a VarBinding")
    g = OnnxGraph(opset, placeholder_above=64)
    for var in relax.analysis.free_vars(binding.value):
        g.env[var] = _placeholder(g, var.ty)
    g.hint = "y"
    result = translate_value(g, binding.value, binding.var.ty)
    g.bind(binding.var, result)
    model = build_onnx(g, result, binding.var.ty)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def binding_accepted(binding: relax.Binding, opset: int = MIN_OPSET) -> bool:
    """Whether one binding translates and ORT has kernels for it (cached per signature)."""
    try:
        key = (opset, binding_key(binding))
    except Exception:  # an unprintable binding is simply refused
        return False
    return probe_once(_ACCEPT_CACHE, _ACCEPT_LOCK, key, lambda: _probe(binding, opset))


# ---------------------------------------------------------------------------------------
# The kernel: one session, I/O bound straight to the caller's buffers


def model_specs(model: onnx.ModelProto) -> tuple[list[Spec], list[Spec]]:
    """(name, dtype, shape) of the inputs and of the outputs of a region's ONNX graph."""
    graph = model.graph
    return (
        [(i.name, _info_dtype(i), _info_shape(i)) for i in graph.input],
        [(o.name, _info_dtype(o), _info_shape(o)) for o in graph.output],
    )


class OrtRegionKernel(BoundKernel):
    """A built region: one ORT session whose I/O is bound to the caller's buffers by pointer
    (no copies: ORT writes the results straight into the destinations); see ``BoundKernel``.
    """

    def __init__(self, session: Any, ins: list[Spec], outs: list[Spec]) -> None:
        super().__init__(ins, outs)
        self.session = session
        self._live = {i.name for i in session.get_inputs()}  # ORT drops unused inputs

    def bind_zero_copy(
        self, args: Sequence[Any], ins: list[np.ndarray], outs: list[np.ndarray]
    ) -> Callable[[], Any]:
        """Bind every input and output by address; returns the cheapest way to run it."""
        binding = self.session.io_binding()
        ptrs = [a.data_ptr() for a in args]
        for view, ptr, (name, _, _) in zip(ins, ptrs[: len(ins)], self._in, strict=True):
            if name in self._live:
                binding.bind_input(name, "cpu", 0, view.dtype, view.shape, ptr)
        for view, ptr, (name, _, _) in zip(outs, ptrs[len(ins) :], self._out, strict=True):
            binding.bind_output(name, "cpu", 0, view.dtype, view.shape, ptr)
        # The C-level objects skip the public wrapper's per-call Python checks.
        c_sess, c_bind = getattr(self.session, "_sess", None), getattr(binding, "_iobinding", None)
        if c_bind is not None and hasattr(c_sess, "run_with_iobinding"):
            return functools.partial(c_sess.run_with_iobinding, c_bind, None)
        return functools.partial(self.session.run_with_iobinding, binding)

    def bind_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], Any]:
        return functools.partial(self._run_copying, ins, outs)

    def _run_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> None:
        feeds = {
            name: v for v, (name, _, _) in zip(ins, self._in, strict=True) if name in self._live
        }
        for dst, res in zip(outs, self.session.run(self.output_names, feeds), strict=True):
            np.copyto(dst, res)


def _info_dtype(info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


def _info_shape(info: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(d.dim_value for d in info.type.tensor_type.shape.dim)


def session_options(threads: int, level: Any) -> Any:
    """ORT options for one CPU session: ``threads`` intra-op threads, sequential, ``level``
    of graph optimisation (``model_file`` runs a user's whole file with them too)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, int(threads))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = level
    so.log_severity_level = 3
    return so


# ORT graph optimisers left out of every session. SkipLayerNormFusion turns Add ->
# LayerNormalization into the contrib SkipLayerNormalization, whose CPU kernel (ORT 1.32) is
# 5-7x slower than the two ops it replaces: (1, 128, 256) 150 us vs 22 us, (1, 128, 768)
# 447 us vs 60 us, one thread. Users' exports rarely match the fusion (symbolic dims), but
# the static graphs relax_to_onnx emits do, so without this the translated distilbert ran
# 1.17x the user's file and deberta 1.01x (0.98x and 0.88x with it; CPU time, interleaved).
DISABLED_OPTIMIZERS: tuple[str, ...] = ("SkipLayerNormFusion",)


def make_session(model: onnx.ModelProto, threads: int, save_optimized: str | None = None) -> Any:
    """One CPU session: all graph optimisations but ``DISABLED_OPTIMIZERS``, sequential,
    ``threads`` intra-op threads.

    ORT's graph optimisers occasionally break a valid model (a fusion drops a tensor
    another node still reads); then the next lower optimisation level is tried.
    ``save_optimized``: where ORT writes the graph it optimised (``load_session`` runs it).
    """
    import onnxruntime as ort

    data = model.SerializeToString()
    levels = [
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    ]
    first: Exception | None = None
    for level in levels:
        so = session_options(threads, level)
        if save_optimized is not None:
            with contextlib.suppress(OSError):  # not a failed level's graph
                os.unlink(save_optimized)
            so.optimized_model_filepath = save_optimized
        try:
            return ort.InferenceSession(
                data,
                so,
                providers=["CPUExecutionProvider"],
                disabled_optimizers=list(DISABLED_OPTIMIZERS),
            )
        except Exception as e:  # noqa: BLE001 - try a lower level, report the first reason
            first = first or e
    raise BackendError(f"onnxruntime could not load the region: {first}") from first


def load_session(path: str, threads: int) -> Any:
    """A session of a graph ORT optimised before (``make_session(save_optimized=...)``): it is
    not optimised again. Such a graph may hold layout-specific ops (NCHWc) of this CPU."""
    import onnxruntime as ort

    so = session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


_ORT_MODEL = "optimized.onnx"


class OnnxRuntimeBackend(OnnxGraphBackend):
    """ONNX Runtime on CPU: graph-level, takes any convex region as one ONNX graph."""

    name = "onnxruntime"

    def accepts(self, binding: relax.Binding) -> bool:
        return binding_accepted(binding, self.opset)

    def kernel(
        self, model: onnx.ModelProto, func: relax.Function, threads: int, precision: str = "f32"
    ) -> OrtRegionKernel:
        """A session with all graph optimisations; a build worker stores the graph ORT optimised."""
        entry = build_cache.current()
        scratch = entry.scratch(".onnx") if entry is not None else None
        try:
            kernel = OrtRegionKernel(make_session(model, threads, scratch), *model_specs(model))
            if entry is not None and scratch is not None and os.path.exists(scratch):

                def write(d: str) -> None:
                    os.replace(scratch, os.path.join(d, _ORT_MODEL))
                    save_specs(d, kernel)

                entry.store(write)
        finally:
            if scratch is not None:
                with contextlib.suppress(OSError):
                    os.unlink(scratch)
        return kernel

    def load_kernel(self, directory: str, threads: int, precision: str = "f32") -> OrtRegionKernel:
        return OrtRegionKernel(
            load_session(os.path.join(directory, _ORT_MODEL), threads), *load_specs(directory)
        )

    def library_version(self) -> str:
        """ORT's version and the optimisers left out: a cached graph was optimised with them."""
        import onnxruntime as ort

        return "+".join([ort.__version__, *(f"no-{o}" for o in DISABLED_OPTIMIZERS)])

    def set_threads(self, threads: int) -> None:
        """Threads are per session (``build_region``); nothing process-wide to set."""
