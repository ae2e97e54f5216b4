"""SEScope and CompilationConfig: where a sub-expression runs, and what is on offer.

An SEScope (tvm-rfcs PR 38) says which device type, virtual device, target, memory
scope and backend run a sub-expression, and here also in which precision it computes
(``f32`` unless the scope says ``bf16``) and on how many threads (the job's, unless the
scope says fewer). "Which compiler" (BYOC) and "which device"
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


F32, BF16, INT8 = "f32", "bf16", "int8"
PRECISIONS = (F32, BF16, INT8)
REDUCED = (BF16, INT8)  # the precisions that trade accuracy for speed, under a budget


class ScopeError(ValueError):
    """An SEScope or CompilationConfig that cannot be valid."""


def _freeze_target(target: dict[str, Any] | None) -> tuple | None:
    return None if target is None else tuple(sorted((k, json.dumps(v)) for k, v in target.items()))


@dataclass(frozen=True)
class SEScope:
    """Storage/execution scope: device type, virtual device id, target, memory scope, backend,
    compute precision and thread count.

    ``precision`` None means f32, the precision the model was given in, and is left out of
    the JSON: every f32 scope, key and plan reads exactly as before precision existed. A
    ``bf16`` scope computes its region in bfloat16 (its inputs and outputs stay f32).

    ``threads`` None means the job's thread count (``--threads``), and is left out of the
    JSON too. A job on many cores may also offer a library's scope on fewer threads: a small
    region (or a small model) runs faster on one thread than split over several, where each
    op pays to wake and join the pool.
    """

    device_type: str | None = None
    virtual_device_id: int | None = None
    target: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    memory_scope: str | None = None
    backend: str | None = None
    precision: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.precision == F32:  # one spelling of f32, so f32 scopes stay equal and keys stay put
            object.__setattr__(self, "precision", None)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ScopeError(
                f"unknown precision '{self.precision}' (known: {', '.join(PRECISIONS)})"
            )
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ScopeError(
                f"a scope's thread count must be a positive integer, not {self.threads!r}"
            )
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
        return (
            self.device_type,
            self.virtual_device_id,
            _freeze_target(self.target),
            self.memory_scope,
            self.backend,
            self.precision,
            self.threads,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SEScope) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def compute_precision(self) -> str:
        """The precision the region computes in: ``f32``, ``bf16`` or ``int8``."""
        return self.precision or F32

    @property
    def choice(self) -> str:
        """The scope as a refinement choice names it: ``backend[/bf16][/1t]``."""
        return "/".join(
            [
                self.backend or "*",
                *([self.precision] if self.precision else []),
                *([f"{self.threads}t"] if self.threads else []),
            ]
        )

    @property
    def is_fully_constrained(self) -> bool:
        """Every field set (precision and threads may stay unset: f32, on the job's threads)."""
        return all(
            getattr(self, f.name) is not None
            for f in fields(self)
            if f.name not in ("precision", "threads")
        )

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
        return replace(
            self,
            **{
                f.name: getattr(other, f.name)
                for f in fields(self)
                if getattr(self, f.name) is None
            },
        )

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
            raise ScopeError(
                f"the {self.backend or 'unnamed'} scope has no target: TVM needs one to compile"
            )
        return tvm.target.Target(dict(self.target))

    def __str__(self) -> str:
        tgt = self.target.get("kind") if self.target else "*"
        vdev = self.virtual_device_id if self.virtual_device_id is not None else "*"
        return (
            f"{self.backend or '*'}@{self.device_type or '*'}:{vdev}"
            f"/{tgt}/{self.memory_scope or '*'}"
            + (f"/{self.precision}" if self.precision else "")
            + (f"/{self.threads}t" if self.threads else "")
        )


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
                raise ScopeError(
                    f"the {s.backend or 'unnamed'} scope of a CompilationConfig must be fully "
                    "constrained (device, virtual device, target, memory scope, backend)"
                )
        if self.default not in self.primitives:
            raise ScopeError("the default scope must be one of the primitive scopes")
        places = [(s.backend, s.virtual_device_id, s.precision, s.threads) for s in self.primitives]
        if len(set(places)) != len(places):
            raise ScopeError(
                "two primitive scopes share a backend, virtual device, precision and thread count"
            )

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.backend for s in self.primitives))

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.compute_precision for s in self.primitives))

    @property
    def variants(self) -> tuple[tuple[str, int | None], ...]:
        """The (precision, threads) pairs on offer, f32 on the job's threads first."""
        return tuple(dict.fromkeys((s.compute_precision, s.threads) for s in self.primitives))

    def scope_for(self, backend: str, precision: str = F32, threads: int | None = None) -> SEScope:
        for s in self.primitives:
            if s.backend == backend and s.compute_precision == precision and s.threads == threads:
                return s
        raise ScopeError(f"no scope for backend '{backend}' (on offer: {', '.join(self.backends)})")

    def scope_named(self, choice: str) -> SEScope:
        """The primitive scope whose ``choice`` name this is."""
        for s in self.primitives:
            if s.choice == choice:
                return s
        raise ScopeError(
            f"no scope '{choice}' (on offer: {', '.join(s.choice for s in self.primitives)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host.to_json(),
            "default": self.default.to_json(),
            "primitives": [s.to_json() for s in self.primitives],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompilationConfig:
        try:
            return cls(
                host=SEScope.from_json(data["host"]),
                default=SEScope.from_json(data["default"]),
                primitives=tuple(SEScope.from_json(s) for s in data["primitives"]),
            )
        except (KeyError, TypeError) as e:
            raise ScopeError(f"malformed CompilationConfig: {e}") from e

    @classmethod
    def for_cpu(
        cls,
        backends: list[str],
        threads: int = 1,
        native: str = "tvm",
        bf16: tuple[str, ...] = (),
        one_thread: tuple[str, ...] = (),
        int8: tuple[str, ...] = (),
    ) -> CompilationConfig:
        """One f32 CPU scope per backend, a bf16 one for each backend in ``bf16``, an int8 one
        for each in ``int8``, and, on more than one thread, a one-thread twin of each scope of
        the backends in ``one_thread``; the native backend's f32 scope is the default and the
        host."""
        if native not in backends:
            backends = [native, *backends]
        target = cpu_target(threads)
        prims = tuple(SEScope("cpu", 0, target, "global", b) for b in backends)
        prims += tuple(SEScope("cpu", 0, target, "global", b, BF16) for b in backends if b in bf16)
        prims += tuple(SEScope("cpu", 0, target, "global", b, INT8) for b in backends if b in int8)
        if threads > 1:
            prims += tuple(replace(s, threads=1) for s in prims if s.backend in one_thread)
        default = next(s for s in prims if s.backend == native)
        return cls(host=default, primitives=prims, default=default)
