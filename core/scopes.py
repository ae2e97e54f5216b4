"""SEScope and CompilationConfig: where a sub-expression runs, and what is on offer.

An SEScope (tvm-rfcs PR 38) says which device type, virtual device, target, memory
scope and backend run a sub-expression. "Which compiler" (BYOC) and "which device"
(device planning) are one question, so one value answers both. Every field may be left
unconstrained (``None``); ``join`` combines two compatible scopes and ``default`` fills
the gaps of one from another, as in the RFC.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# Target kinds and the device type each one runs on.
TARGET_DEVICE_TYPES: dict[str, str] = {
    "llvm": "cpu",
    "c": "cpu",
    "cuda": "cuda",
    "rocm": "rocm",
    "vulkan": "vulkan",
    "metal": "metal",
    "opencl": "opencl",
}


class ScopeError(ValueError):
    """An SEScope or CompilationConfig that cannot be valid."""


def _freeze_target(target: dict[str, Any] | None) -> tuple | None:
    return None if target is None else tuple(sorted((k, json.dumps(v)) for k, v in target.items()))


@dataclass(frozen=True)
class SEScope:
    """Storage/execution scope: device type, virtual device id, target, memory scope, backend."""

    device_type: str | None = None
    virtual_device_id: int | None = None
    target: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    memory_scope: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.target is not None:
            kind = self.target.get("kind")
            if kind is None:
                raise ScopeError(f"target {self.target} has no 'kind'")
            want = TARGET_DEVICE_TYPES.get(kind)
            if want and self.device_type and self.device_type != want:
                raise ScopeError(
                    f"target kind '{kind}' runs on device type '{want}', not '{self.device_type}'"
                )

    # Equality and hashing include the target's contents.
    def _key(self) -> tuple:
        return (self.device_type, self.virtual_device_id, _freeze_target(self.target),
                self.memory_scope, self.backend)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SEScope) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def is_fully_constrained(self) -> bool:
        return all(getattr(self, f.name) is not None for f in fields(self))

    def join(self, other: SEScope) -> SEScope | None:
        """The scope satisfying both, or None when a field is constrained differently."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is not None and b is not None and a != b:
                return None
            out[f.name] = a if a is not None else b
        try:
            return SEScope(**out)
        except ScopeError:
            return None

    def default(self, other: SEScope) -> SEScope:
        """This scope, with its unconstrained fields taken from ``other``."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self)
                                if getattr(self, f.name) is None})

    def compatible(self, other: SEScope) -> bool:
        return self.join(other) is not None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SEScope:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ScopeError(f"unknown SEScope field(s): {sorted(unknown)}")
        return cls(**data)

    def tvm_target(self):
        """The TVM Target of this scope (a JSON dict, as TVM 0.27 wants)."""
        import tvm

        if self.target is None:
            raise ScopeError(f"the {self.backend or 'unnamed'} scope has no target: TVM needs one to compile")
        return tvm.target.Target(dict(self.target))

    def __str__(self) -> str:
        tgt = self.target.get("kind") if self.target else "*"
        return (f"{self.backend or '*'}@{self.device_type or '*'}:{self.virtual_device_id if self.virtual_device_id is not None else '*'}"
                f"/{tgt}/{self.memory_scope or '*'}")


def cpu_target(threads: int = 1) -> dict[str, Any]:
    """The llvm target for this host CPU."""
    return {"kind": "llvm", "num-cores": threads}


@dataclass(frozen=True)
class CompilationConfig:
    """Host scope, the primitive scopes on offer (one per backend x device), the default."""

    host: SEScope
    primitives: tuple[SEScope, ...]
    default: SEScope

    def __post_init__(self) -> None:
        for s in (self.host, self.default, *self.primitives):
            if not s.is_fully_constrained:
                raise ScopeError(f"the {s.backend or 'unnamed'} scope of a CompilationConfig must be fully "
                                 "constrained (device, virtual device, target, memory scope, backend)")
        if self.default not in self.primitives:
            raise ScopeError("the default scope must be one of the primitive scopes")
        names = [s.backend for s in self.primitives]
        if len(set(zip(names, [s.virtual_device_id for s in self.primitives], strict=True))) != len(names):
            raise ScopeError("two primitive scopes share a backend and virtual device")

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.backend for s in self.primitives))

    def scope_for(self, backend: str) -> SEScope:
        for s in self.primitives:
            if s.backend == backend:
                return s
        raise ScopeError(f"no scope for backend '{backend}' (on offer: {', '.join(self.backends)})")

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host.to_json(), "default": self.default.to_json(),
                "primitives": [s.to_json() for s in self.primitives]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompilationConfig:
        try:
            return cls(host=SEScope.from_json(data["host"]), default=SEScope.from_json(data["default"]),
                       primitives=tuple(SEScope.from_json(s) for s in data["primitives"]))
        except (KeyError, TypeError) as e:
            raise ScopeError(f"malformed CompilationConfig: {e}") from e

    @classmethod
    def for_cpu(cls, backends: list[str], threads: int = 1, native: str = "tvm") -> CompilationConfig:
        """One CPU scope per backend; the native backend is the default and the host."""
        if native not in backends:
            backends = [native, *backends]
        target = cpu_target(threads)
        prims = tuple(SEScope("cpu", 0, target, "global", b) for b in backends)
        default = next(s for s in prims if s.backend == native)
        return cls(host=default, primitives=prims, default=default)
