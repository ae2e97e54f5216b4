"""The Runner interface: take a measurement request, return what was measured.

A request is a JSON-able dict built by ``runners.builder`` (a region or a whole plan);
a runner decides where it is timed: a local worker process, or a server reached
through a TVM RPC tracker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from runners.timing import Measurement


class Runner(ABC):
    @abstractmethod
    def run(self, request: dict) -> Measurement:
        """Measure one request. Crashes and hangs give a failed Measurement, never raise."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release workers or sessions."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
