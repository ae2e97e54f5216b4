"""The Runner interface: take a measurement request, return what was measured.

A request is a JSON-able dict built by ``partune.runners.builder`` (a region, a whole plan, or
a comparison of plans and peers); a runner decides where it is timed: a local worker
process, or a server reached through a TVM RPC tracker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from partune.runners.timing import Measurement


class Runner(ABC):
    timeout_s: float = 120.0

    @abstractmethod
    def exchange(self, request: dict, timeout_s: float | None = None) -> dict:
        """Send one request, return the worker's reply; ``{"error": why}`` on a crash or hang."""

    def run(self, request: dict) -> Measurement:
        """Measure one region or plan. Crashes and hangs give a failed Measurement, never raise."""
        reply = self.exchange(request)
        if "error" in reply:
            return Measurement.failed(reply["error"])
        return Measurement(**reply["measurement"])

    def compare(self, request: dict, timeout_s: float | None = None) -> dict[str, Measurement]:
        """Time several contenders in one process, interleaved; a crash fails them all."""
        reply = self.exchange(request, timeout_s)
        if "measurements" not in reply:
            why = reply.get("error") or Measurement(**reply["measurement"]).error
            return {label: Measurement.failed(str(why)) for label in request["contenders"]}
        return {label: Measurement(**m) for label, m in reply["measurements"].items()}

    def tune(self, request: dict, timeout_s: float) -> dict:
        """Tune a region where it will be measured; its report, or ``{"error": why}``."""
        reply = self.exchange(request, timeout_s)
        if "tuning" in reply:
            return reply["tuning"]
        return {"error": reply.get("error") or Measurement(**reply["measurement"]).error}

    def close(self) -> None:  # noqa: B027 - optional
        """Release workers or sessions."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
