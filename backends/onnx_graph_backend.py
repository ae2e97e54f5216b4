"""The base of the graph-level backends (onnxruntime, OpenVINO): a region as one ONNX graph.

``OnnxGraphBackend`` translates a region (``relax_to_onnx``) and leaves compiling and binding
the graph to its subclass; ``probe_once`` and ``binding_key`` decide an acceptance probe
once per op signature; ``save_specs`` and ``load_specs`` keep a cached kernel's I/O. It is
shared by both backends and specific to neither, so it is in neither's module.
"""

from __future__ import annotations

import json
import os
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import tvm
from tvm import relax

from partune.backends import build_cache
from partune.backends.base import Backend, BackendError, FusionStyle, Level
from partune.backends.kernel import BoundKernel, Spec
from partune.backends.relax_onnx import MIN_OPSET, relax_to_onnx
from partune.core import function_in_int8, int8_ready

if TYPE_CHECKING:
    from partune.core import SEScope


# ---------------------------------------------------------------------------------------
# accepts(): a probe per op signature, decided once


def _arg_key(expr: Any) -> Any:
    if isinstance(expr, relax.Tuple):
        return ("tuple", tuple(_arg_key(f) for f in expr.fields))
    if isinstance(expr, tvm.tirx.IntImm | tvm.tirx.FloatImm):
        return ("prim", str(expr.ty), expr.value)
    if isinstance(expr, relax.ShapeExpr):
        return ("shape", str(expr))
    return (type(expr).__name__, str(getattr(expr, "ty", None)))


def binding_key(binding: relax.Binding) -> tuple:
    value = binding.value
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        head: Any = (value.op.name, str(value.attrs), tuple(_arg_key(a) for a in value.args))
    elif isinstance(value, relax.TupleGetItem):
        head = ("getitem", int(value.index), _arg_key(value.tuple_value))
    else:
        head = _arg_key(value)
    return (head, str(binding.var.ty))


def probe_once(cache: dict, lock: threading.Lock, key: Any, probe: Callable[[], object]) -> bool:
    """Whether ``probe()`` runs without raising, decided once per ``key`` and remembered.

    Any failure (translation, checker, the runtime refusing the graph) means refuse.
    """
    with lock:
        if key in cache:
            return cache[key]
    try:
        probe()
        ok = True
    except Exception:  # noqa: BLE001 - whatever the reason, the op is not accepted
        ok = False
    with lock:
        cache[key] = ok
    return ok


# ---------------------------------------------------------------------------------------
# The backend base, and the I/O specs of a cached kernel


_SPECS = "specs.json"  # a cached region kernel's input and output names, dtypes and shapes


def save_specs(directory: str, kernel: BoundKernel) -> None:
    doc = {
        side: [[n, str(d), list(s)] for n, d, s in specs]
        for side, specs in zip(("inputs", "outputs"), kernel.specs, strict=True)
    }
    with open(os.path.join(directory, _SPECS), "w") as f:
        json.dump(doc, f)


def load_specs(directory: str) -> tuple[list[Spec], list[Spec]]:
    with open(os.path.join(directory, _SPECS)) as f:
        doc = json.load(f)
    return tuple(
        [(n, np.dtype(d), tuple(s)) for n, d, s in doc[side]]  # type: ignore[return-value]
        for side in ("inputs", "outputs")
    )


class OnnxGraphBackend(Backend):
    """A graph-level CPU backend that takes a region as one ONNX graph (``relax_to_onnx``).

    onnxruntime and OpenVINO differ only in which ops they accept and how they compile
    and bind the graph (``kernel``); the translation and its checks are shared.
    """

    level = Level.COMPILER
    fusion_style = FusionStyle.ARBITRARY
    device_types = ("cpu",)
    caches_builds = True
    threads_per_region = True  # a session (compiled model) per region, with its own thread count
    int8 = True  # both libraries run QDQ matmuls and convolutions on int8 kernels

    def __init__(self, opset: int = MIN_OPSET) -> None:
        if opset < MIN_OPSET:
            raise BackendError(f"opset {opset} < {MIN_OPSET}")
        self.opset = opset

    def build_region(self, func: relax.Function, scope: SEScope, threads: int) -> Any:
        """Translate and compile; with a build cache active, load what was compiled before
        (nothing is translated then), or store what is compiled (build workers)."""
        if scope.device_type not in (None, *self.device_types):
            raise BackendError(f"{self.name} backend runs on cpu, not {scope.device_type}")
        threads = scope.threads or threads  # a scope on fewer threads than the job's
        precision = scope.compute_precision
        if not {"f32": True, "bf16": self.bf16, "int8": self.int8}[precision]:
            raise BackendError(f"{self.name} has no {precision} path")
        if precision == "int8":  # QDQ form, compiled as it stands: the library's int8 kernels
            func = (
                func if int8_ready(func) else function_in_int8(func, placement=self.int8_placement)
            )
            precision = "f32"
        entry = build_cache.current()
        if entry is not None:
            entry.refine(self.name, self.library_version(), self.opset)
            kernel = entry.load(lambda d: self.load_kernel(d, threads, precision))
            if kernel is not None:
                return kernel
        return self.kernel(relax_to_onnx(func, self.opset), func, threads, precision)

    @abstractmethod
    def kernel(
        self, model: onnx.ModelProto, func: relax.Function, threads: int, precision: str = "f32"
    ) -> Any:
        """Compile the region's ONNX graph to compute in ``precision`` and return its
        destination-passing kernel (stored in the active build cache entry, if any, for
        ``load_kernel``)."""

    @abstractmethod
    def load_kernel(self, directory: str, threads: int, precision: str = "f32") -> Any:
        """The kernel ``kernel`` stored in a build cache entry's directory."""

    @abstractmethod
    def library_version(self) -> str:
        """The compiler's version (a cached build of another version is not used)."""
