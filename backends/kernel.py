"""The skeleton both graph-level backends' region kernels share: bind once, run often.

A region kernel is called destination-passing style, ``kernel(*inputs, *outputs)``, with
TVM tensors. Binding the caller's buffers to a runtime (ORT io-binding, OpenVINO tensors
wrapping memory) costs far more than running a small region, so a binding is made and
validated (dtype, shape, contiguity) the first time a set of buffers is seen and kept
for the next ``MAX_BINDINGS`` sets, keyed by address and element count: a call on known
buffers costs a dict lookup plus the runtime's own run. Calls are serialised by a lock.
A subclass says how to bind without copies, and how to run copying when it cannot.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tvm

from partune.backends.base import BackendError

Spec = tuple[str, np.dtype, tuple[int, ...]]  # (name, dtype, shape) of one input or output

_data_ptr = tvm.runtime.Tensor.data_ptr
_numel = tvm.runtime.Tensor.numel


class BoundKernel(ABC):
    MAX_BINDINGS = 8

    def __init__(self, ins: list[Spec], outs: list[Spec]) -> None:
        self._in, self._out = ins, outs
        self._bound: dict[tuple, Callable[[], Any]] = {}
        self._lock = threading.Lock()
        self.zero_copy = True  # False once a binding had to fall back to copying

    @property
    def specs(self) -> tuple[list[Spec], list[Spec]]:
        """(name, dtype, shape) of the inputs and of the outputs, in call order."""
        return self._in, self._out

    @property
    def input_names(self) -> list[str]:
        return [n for n, _, _ in self._in]

    @property
    def output_names(self) -> list[str]:
        return [n for n, _, _ in self._out]

    def __call__(self, *args: Any) -> None:
        key = (*map(_data_ptr, args), *map(_numel, args))
        with self._lock:
            run = self._bound.get(key)
            if run is None:
                run = self._bind(args, key)
            run()

    def _bind(self, args: Sequence[Any], key: tuple) -> Callable[[], Any]:
        n_in, specs = len(self._in), self._in + self._out
        if len(args) != len(specs):
            raise BackendError(f"kernel takes {len(specs)} tensors, got {len(args)}")
        views = [np.from_dlpack(a) for a in args]
        for view, (name, dtype, shape) in zip(views, specs, strict=True):
            if view.dtype != dtype or view.shape != shape or not view.flags.c_contiguous:
                raise BackendError(
                    f"{name}: got {view.dtype}{list(view.shape)}, want {dtype}{list(shape)}"
                )
        try:
            run = self.bind_zero_copy(args, views[:n_in], views[n_in:])
        except (RuntimeError, TypeError, ValueError):  # a buffer the runtime will not wrap: copy
            run = self.bind_copying(views[:n_in], views[n_in:])
            self.zero_copy = False
        if len(self._bound) >= self.MAX_BINDINGS:
            self._bound.pop(next(iter(self._bound)))
        self._bound[key] = run
        return run

    @abstractmethod
    def bind_zero_copy(
        self, args: Sequence[Any], ins: list[np.ndarray], outs: list[np.ndarray]
    ) -> Callable[[], Any]:
        """Bind inputs and outputs to the caller's memory; raise if the runtime would copy."""

    @abstractmethod
    def bind_copying(self, ins: list[np.ndarray], outs: list[np.ndarray]) -> Callable[[], Any]:
        """A run that copies inputs in and results out (the fallback)."""
