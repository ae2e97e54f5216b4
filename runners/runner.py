"""The Runner interface: take a measurement request, return what was measured.

A request is one of ``partune.runners.protocol``'s typed requests, made by
``partune.runners.builder`` (a region, a whole plan, a comparison of plans and peers, a
tuning); a runner decides where it is timed: a local worker process, or a server reached
through a TVM RPC tracker. Replies are read by their type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Any

from partune.backends import registry
from partune.runners.protocol import (
    CompareRequest,
    MeasurementReply,
    MeasurementsReply,
    Reply,
    Request,
    TuneRequest,
    TuningReply,
    failure_of,
)
from partune.runners.timing import Measurement


class Runner(ABC):
    timeout_s: float = 120.0
    threads: int = 1
    # Whether its worker reads this machine's files: region requests may then name the model's
    # file instead of carrying their weights (``partune.runners.builder.region_request``).
    reads_local_files: bool = False

    def addressed(self, request: Request) -> Request:
        """``request`` as this runner sends it: with its thread count and this process's
        settings (``partune.backends.settings``), so the worker builds as the search would."""
        return replace(request, threads=self.threads, settings=registry.settings())

    @abstractmethod
    def exchange(self, request: Request, timeout_s: float | None = None) -> Reply:
        """Send one request, return the worker's reply; an ``ErrorReply`` on a crash or hang."""

    def run(self, request: Request) -> Measurement:
        """Measure one region or plan. Crashes and hangs give a failed Measurement, never raise."""
        reply = self.exchange(request)
        if isinstance(reply, MeasurementReply):
            return reply.measurement
        return Measurement.failed(failure_of(reply))

    def compare(
        self, request: CompareRequest, timeout_s: float | None = None
    ) -> dict[str, Measurement]:
        """Time several contenders in one process, interleaved; a crash fails them all."""
        reply = self.exchange(request, timeout_s)
        if isinstance(reply, MeasurementsReply):
            return dict(reply.measurements)
        why = failure_of(reply)
        return {label: Measurement.failed(why) for label in request.contenders}

    def captured(
        self, mod: Any, graph: Any, inputs: list, backends: list[str], model_file: Path | None
    ) -> dict:
        """The model's values on ``inputs`` (``partune.runners.capture``), computed in this process:
        a remote worker cannot read ``model_file`` (the model as ``partune.runners.module_file``
        wrote it; None unless the runner ``reads_local_files``). Raises when no backend can build
        the whole model."""
        from partune.runners.capture import capture_values

        return capture_values(mod, graph, inputs, backends)

    def tune(self, request: TuneRequest, timeout_s: float) -> dict[str, Any]:
        """Tune a region where it will be measured; its report, or ``{"error": why}``."""
        reply = self.exchange(request, timeout_s)
        if isinstance(reply, TuningReply):
            return reply.report
        return {"error": failure_of(reply)}

    def device(self) -> str:
        """The fingerprint of the device this runner measures on: the store keeps each
        device's measurements apart (``partune.store.measurements``). Here: this machine."""
        from partune.core import device_fingerprint

        return device_fingerprint(self.threads)

    def available_bytes(self) -> int | None:
        """Memory the device can give a comparison now; None where unknown (a remote device)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Release workers or sessions."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
