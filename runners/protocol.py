"""What travels between the search and the processes that measure: typed requests and replies.

A request is one of ``RegionRequest``, ``TuneRequest``, ``PlanRequest``, ``CompareRequest``,
``BuildRequest`` and ``CaptureRequest`` (made by ``partune.runners.builder`` and
``partune.runners.build_pool``); the worker answers each with a ``MeasurementReply``,
``MeasurementsReply``, ``TuningReply``, ``BuildReply``, ``CaptureReply`` or ``ErrorReply``. They
cross a pipe (a local worker) or TVM RPC (a remote one) as the same JSON text
(``to_json``/``from_json``), and arrays travel inside them as base64 ``.npy``. Nothing is
pickled: what a message decodes to never runs code.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

from partune.backends import Settings
from partune.core import Plan, SEScope
from partune.runners.timing import Measurement, Protocol


def encode_array(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def decode_array(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)


# -- Requests and replies ---------------------------------------------------------------------
#
# Each is a frozen dataclass with a ``kind`` tag. ``to_json`` gives a JSON-able dict (the
# RPC path sends it as text; a field that is None is left out), ``from_json`` reads one
# back exactly. The local pipe and RPC send the same text.


class ProtocolError(ValueError):
    """A JSON message that is not a request or reply of this protocol."""


_Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]
_SAME: _Codec = (lambda v: v, lambda v: v)
_SCOPE: _Codec = (SEScope.to_json, SEScope.from_json)
_PROTOCOL: _Codec = (asdict, lambda d: Protocol(**d))
_ARRAYS: _Codec = (list, tuple)  # base64 .npy texts (``encode_array``)
_TUPLE: _Codec = (list, tuple)  # backend names
_PLAN: _Codec = (Plan.to_json, Plan.from_json)
_SETTINGS: _Codec = (Settings.to_json, Settings.from_json)
_MEASUREMENT: _Codec = (Measurement.to_json, lambda d: Measurement(**d))
_MEASUREMENTS: _Codec = (
    lambda ms: {label: m.to_json() for label, m in ms.items()},
    lambda d: {label: Measurement(**m) for label, m in d.items()},
)


def _contender_to_json(c: Plan | dict) -> dict:
    return {"kind": "plan", "plan": c.to_json()} if isinstance(c, Plan) else c


def _contender_from_json(d: dict) -> Plan | dict:
    return Plan.from_json(d["plan"]) if d.get("kind") == "plan" else dict(d)


_CONTENDERS: _Codec = (
    lambda cs: {label: _contender_to_json(c) for label, c in cs.items()},
    lambda d: {label: _contender_from_json(c) for label, c in d.items()},
)


@dataclass(frozen=True)
class ModelRef:
    """The model a request is about, given one of two ways: ``text``, its ``tvm.ir.save_json``
    carried in the request (what a worker on another machine needs), or ``file``, a file that a
    worker on this machine reads (``partune.runners.module_file``), so that no request carries
    weights as text. With ``file``, ``nodes`` names the region of its main that the worker
    lifts itself (region and build requests).
    """

    text: str | None = None
    file: str | None = None
    nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.file is None):
            raise ProtocolError(
                "a model reference holds either the model's text or its file, not both or neither"
            )
        if self.nodes is not None and self.file is None:
            raise ProtocolError("a model reference names nodes only of a model's file")

    @classmethod
    def of(cls, model: str | Path) -> ModelRef:
        """The reference to ``model``: a ``Path`` is a file, a string the model's text."""
        return cls(file=str(model)) if isinstance(model, Path) else cls(text=model)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text} if self.text is not None else {"file": self.file}
        return out | ({"nodes": list(self.nodes)} if self.nodes is not None else {})

    @classmethod
    def from_json(cls, data: Any) -> ModelRef:
        if not isinstance(data, dict) or set(data) - {"text", "file", "nodes"}:
            raise ProtocolError(f"not a model reference: {str(data)[:80]}")
        nodes = data.get("nodes")
        return cls(data.get("text"), data.get("file"), tuple(nodes) if nodes is not None else None)

    @property
    def size(self) -> int:
        """The characters the reference holds (a file's: its name only)."""
        return len(self.text if self.text is not None else self.file or "")


_MODEL: _Codec = (ModelRef.to_json, ModelRef.from_json)


@dataclass(frozen=True)
class Validation:
    """What a reduced-precision plan's (or peer's) error is judged on: the user's validation
    ``samples`` (each a tuple of base64 ``.npy`` arrays, in model input order) by ``metric``
    (``partune.runners.accuracy.METRICS``). A request without one is judged as before: on its
    inputs and the held-out draw like them, by relative error."""

    samples: tuple[tuple[str, ...], ...]
    metric: str = "rel"

    @classmethod
    def of(cls, samples: list[list[np.ndarray]], metric: str = "rel") -> Validation:
        return cls(tuple(tuple(encode_array(a) for a in s) for s in samples), metric)

    def arrays(self) -> list[list[np.ndarray]]:
        return [[decode_array(a) for a in s] for s in self.samples]

    @cached_property
    def digest(self) -> str:
        """A name for the samples and metric (in the keys of what they judged), hashed once."""
        return hashlib.sha256(json.dumps(self.to_json()).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {"samples": [list(s) for s in self.samples], "metric": self.metric}

    @classmethod
    def from_json(cls, data: Any) -> Validation:
        if not isinstance(data, dict) or set(data) != {"samples", "metric"}:
            raise ProtocolError(f"not a validation set: {str(data)[:80]}")
        return cls(tuple(tuple(s) for s in data["samples"]), str(data["metric"]))


_VALIDATION: _Codec = (Validation.to_json, Validation.from_json)


PROTOCOL_VERSION = 4
"""The wire format's version, in every message. A worker of another Partune (an RPC server
not upgraded with the search) refuses a message of another version with a line naming both,
instead of misreading it. Raise it with any change a reader of the old format would misread."""


class _Message:
    """JSON for a dataclass: its fields, each through its codec (``_codecs``), ``kind`` and
    the protocol ``version``."""

    kind: ClassVar[str]
    _codecs: ClassVar[dict[str, _Codec]] = {}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "version": PROTOCOL_VERSION}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = self._codecs.get(f.name, _SAME)[0](value)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        if not isinstance(data, dict) or data.get("kind") != cls.kind:
            raise ProtocolError(f"not a '{cls.kind}' message: {str(data)[:80]}")
        check_version(data)
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names - {"kind", "version"}
        if unknown:
            raise ProtocolError(f"unknown field(s) of '{cls.kind}': {sorted(unknown)}")
        return cls(
            **{
                k: cls._codecs.get(k, _SAME)[1](v)
                for k, v in data.items()
                if k not in ("kind", "version") and v is not None
            }
        )


def check_version(data: dict[str, Any]) -> None:
    """A one-line error where ``data`` was written by another version of the wire format."""
    version = data.get("version", 1)  # the format before versions: 1
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"a '{data.get('kind')}' message of wire-protocol version {version}; this "
            f"Partune speaks version {PROTOCOL_VERSION} (run the same Partune on the "
            "searching machine and the measuring one)"
        )


@dataclass(frozen=True, kw_only=True)
class _Request(_Message):
    """What every request carries besides its own fields, set by the runner that sends it: the
    threads it runs with, and the backends' settings (None: as the handling process has them)."""

    _codecs: ClassVar[dict[str, _Codec]] = {"module": _MODEL, "settings": _SETTINGS}
    threads: int = 1
    settings: Settings | None = None


@dataclass(frozen=True)
class RegionRequest(_Request):
    """Measure one region in isolation on ``scope``: ``function`` of ``module``'s text, or the
    region of ``module.nodes`` of the whole model's file (``partune.runners.module_file``), which
    the worker lifts itself: such a request carries no weights (a BERT-768 layer is 16 MB of
    JSON, made and parsed per request).
    ``inputs``: what the region reads inside the model (else the worker draws random ones).
    ``build_cache``: a directory where a build pool may have built it (``build_cache_once``:
    remove the entry once loaded). ``threads`` and ``settings`` are set by the runner.
    """

    kind: ClassVar[str] = "region"
    _codecs = _Request._codecs | {"scope": _SCOPE, "protocol": _PROTOCOL, "inputs": _ARRAYS}
    backend: str
    scope: SEScope
    module: ModelRef
    function: str
    protocol: Protocol = field(default_factory=Protocol)
    inputs: tuple[str, ...] | None = None
    build_cache: str | None = None
    build_cache_once: bool = False


@dataclass(frozen=True)
class TuneRequest(_Request):
    """Tune one region for its (autotuned) backend, where it will be measured."""

    kind: ClassVar[str] = "tune"
    _codecs = _Request._codecs | {"scope": _SCOPE}
    backend: str
    scope: SEScope
    module: ModelRef
    function: str
    trials: int
    timeout_s: float


@dataclass(frozen=True)
class PlanRequest(_Request):
    """Build the whole model under ``plan`` and time it end to end.

    ``fresh``: in a new worker process, so the peak memory reported is this plan's alone.
    ``validation``: what a plan with bf16 or int8 regions is judged on (``Validation``).
    """

    kind: ClassVar[str] = "plan"
    _codecs = _Request._codecs | {
        "plan": _PLAN,
        "inputs": _ARRAYS,
        "protocol": _PROTOCOL,
        "validation": _VALIDATION,
    }
    module: ModelRef
    plan: Plan
    inputs: tuple[str, ...]
    protocol: Protocol = field(default_factory=Protocol)
    fresh: bool = False
    validation: Validation | None = None


@dataclass(frozen=True)
class CompareRequest(_Request):
    """Time contenders in one process, interleaved: plans, and peers (``partune.runners.peers``
    specs)."""

    kind: ClassVar[str] = "compare"
    _codecs = _Request._codecs | {
        "contenders": _CONTENDERS,
        "inputs": _ARRAYS,
        "validation": _VALIDATION,
    }
    module: ModelRef
    contenders: dict[str, Plan | dict[str, Any]]
    inputs: tuple[str, ...]
    rounds: int = 5
    validation: Validation | None = None


@dataclass(frozen=True)
class BuildRequest(_Request):
    """Build a region into ``build_cache`` (a build pool's worker); nothing is timed."""

    kind: ClassVar[str] = "build"
    _codecs = _Request._codecs | {"scope": _SCOPE}
    backend: str
    scope: SEScope
    module: ModelRef
    function: str
    build_cache: str

    @classmethod
    def of(cls, region: RegionRequest, build_cache: str) -> BuildRequest:
        """The build of ``region``'s kernel into ``build_cache``."""
        return cls(region.backend, region.scope, region.module, region.function, build_cache)


@dataclass(frozen=True)
class CaptureRequest(_Request):
    """Run the whole model once on ``inputs`` and write every value it computes inside into
    ``out_file`` (``partune.runners.capture``).

    Captured in a worker, the whole-model build (a BERT-768 at 12 layers took the search process
    from 2.1 to 3.5 GB) and a crash in it are the worker's, not the search's."""

    kind: ClassVar[str] = "capture"
    _codecs = _Request._codecs | {"inputs": _ARRAYS, "backends": _TUPLE}
    module: ModelRef
    inputs: tuple[str, ...]
    backends: tuple[str, ...]
    out_file: str


@dataclass(frozen=True)
class BuildInfo:
    """How a region's build went: seconds (None: not built) and what the build cache did."""

    cache: str
    build_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"cache": self.cache} | (
            {"build_s": self.build_s} if self.build_s is not None else {}
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BuildInfo:
        return cls(data["cache"], data.get("build_s"))


_BUILD: _Codec = (BuildInfo.to_json, BuildInfo.from_json)


@dataclass(frozen=True)
class MeasurementReply(_Message):
    """One measurement (failed ones included); a region's says how its build went, a
    failure carries the worker's traceback."""

    kind: ClassVar[str] = "measurement"
    _codecs: ClassVar[dict[str, _Codec]] = {"measurement": _MEASUREMENT, "build": _BUILD}
    measurement: Measurement
    build: BuildInfo | None = None
    trace: str | None = None


@dataclass(frozen=True)
class MeasurementsReply(_Message):
    """A comparison's measurements, per contender label."""

    kind: ClassVar[str] = "measurements"
    _codecs: ClassVar[dict[str, _Codec]] = {"measurements": _MEASUREMENTS}
    measurements: dict[str, Measurement]


@dataclass(frozen=True)
class TuningReply(_Message):
    """A tuning's report (what the backend's ``tune_region`` returned)."""

    kind: ClassVar[str] = "tuning"
    report: dict[str, Any]


@dataclass(frozen=True)
class BuildReply(_Message):
    """What a build request did."""

    kind: ClassVar[str] = "build"
    _codecs: ClassVar[dict[str, _Codec]] = {"build": _BUILD}
    build: BuildInfo


@dataclass(frozen=True)
class CaptureReply(_Message):
    """A capture done: the file that holds the values."""

    kind: ClassVar[str] = "captured"
    file: str


@dataclass(frozen=True)
class ErrorReply(_Message):
    """No reply from the worker (a crash, a hang, an RPC failure) or a build that failed: why."""

    kind: ClassVar[str] = "error"
    error: str


Request = RegionRequest | TuneRequest | PlanRequest | CompareRequest | BuildRequest | CaptureRequest
Reply = MeasurementReply | MeasurementsReply | TuningReply | BuildReply | CaptureReply | ErrorReply

REQUEST_TYPES: dict[str, type[Request]] = {
    t.kind: t
    for t in (RegionRequest, TuneRequest, PlanRequest, CompareRequest, BuildRequest, CaptureRequest)
}
REPLY_TYPES: dict[str, type[Reply]] = {
    t.kind: t
    for t in (
        MeasurementReply,
        MeasurementsReply,
        TuningReply,
        BuildReply,
        CaptureReply,
        ErrorReply,
    )
}


def request_from_json(data: dict[str, Any]) -> Request:
    """The request a JSON dict holds, by its ``kind``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in REQUEST_TYPES:
        raise ProtocolError(f"unknown request kind {kind!r}")
    return REQUEST_TYPES[kind].from_json(data)


def reply_from_json(data: dict[str, Any]) -> Reply:
    """The reply a JSON dict holds, by its ``kind``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in REPLY_TYPES:
        raise ProtocolError(f"unknown reply kind {kind!r}")
    return REPLY_TYPES[kind].from_json(data)


def failure_of(reply: Reply) -> str:
    """Why a reply is not what was asked for: its error, or its failed measurement's."""
    if isinstance(reply, ErrorReply):
        return reply.error
    if isinstance(reply, MeasurementReply):
        return str(reply.measurement.error)
    return f"unexpected '{reply.kind}' reply"
