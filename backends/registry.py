"""The one place that knows which backends exist. The search reaches backends only here.

Backend modules import heavy libraries (torch, onnxruntime), so they are imported
lazily, the first time a backend is asked for by name.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from partune.backends.base import Backend
from partune.backends.settings import Settings
from partune.core import cpu_flags

_BACKENDS: dict[str, str] = {
    "tvm": "partune.backends.tvm_backend:TvmBackend",
    "tvm-tuned": "partune.backends.tvm_tuned_backend:TunedTvmBackend",
    "torch": "partune.backends.torch_backend:TorchBackend",
    "onnxruntime": "partune.backends.onnxruntime_backend:OnnxRuntimeBackend",
    "openvino": "partune.backends.openvino_backend:OpenVinoBackend",
}
NATIVE = "tvm"

_instances: dict[str, Backend] = {}
_threads = {"n": 1}
_settings = {"now": Settings()}


class UnknownBackendError(KeyError):
    """A backend name that is not registered."""

    def __str__(self) -> str:
        return f"unknown backend '{self.args[0]}' (known: {', '.join(names())})"


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def default_names() -> list[str]:
    """The backends offered when the user names none (not those that need work up front)."""
    return [n for n in _BACKENDS if get(n).offered_by_default]


def cpu_has_bf16() -> bool:
    """Whether this CPU reports bfloat16 instructions (AVX512-BF16 or AMX-BF16): the only
    CPUs on which a bf16 region is faster rather than emulated."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def threads_per_region_names(backends: list[str]) -> tuple[str, ...]:
    """Those of ``backends`` whose regions may run on fewer threads than the job's."""
    return tuple(b for b in backends if get(b).threads_per_region)


def bf16_names(backends: list[str]) -> tuple[str, ...]:
    """Those of ``backends`` with a real bf16 path on this CPU (none where it has no bf16)."""
    return tuple(b for b in backends if get(b).bf16) if cpu_has_bf16() else ()


def int8_names(backends: list[str]) -> tuple[str, ...]:
    """Those of ``backends`` that run int8 (QDQ) regions on integer kernels."""
    return tuple(b for b in backends if get(b).int8)


def register(name: str, target: str) -> None:
    """Register a backend class by ``module:Class`` path (used for test-only backends).

    It joins the settings, so the workers and RPC servers measuring for this process
    know it too."""
    extra = tuple(e for e in _settings["now"].extra_backends if e[0] != name) + ((name, target),)
    configure(replace(_settings["now"], extra_backends=extra))
    _instances.pop(name, None)


def unregister(name: str) -> None:
    """Forget a backend registered with ``register``."""
    extra = tuple(e for e in _settings["now"].extra_backends if e[0] != name)
    configure(replace(_settings["now"], extra_backends=extra))
    _BACKENDS.pop(name, None)
    _instances.pop(name, None)


def configure(settings: Settings) -> None:
    """Use ``settings`` from now on (a no-op when they are the ones in use): extra backends
    are registered, and every backend built so far reads them again."""
    if settings == _settings["now"]:
        return
    _settings["now"] = settings
    for name, target in settings.extra_backends:
        _BACKENDS[name] = target
    for backend in _instances.values():
        backend.configure(settings)


def settings() -> Settings:
    """The settings in use (runners copy them into every request)."""
    return _settings["now"]


def get(name: str) -> Backend:
    if name not in _BACKENDS:
        raise UnknownBackendError(name)
    if name not in _instances:
        module, cls = _BACKENDS[name].split(":")
        backend = getattr(importlib.import_module(module), cls)()
        backend.configure(_settings["now"])
        backend.set_threads(_threads["n"])
        _instances[name] = backend
    return _instances[name]


def set_threads(threads: int) -> None:
    """One thread count for every backend (one thread each is the stable setting here)."""
    _threads["n"] = threads
    for backend in _instances.values():
        backend.set_threads(threads)


def threads() -> int:
    return _threads["n"]
