"""The timing protocol every measurement in Partune follows, so numbers compare.

Warm-up runs, then ``repeat`` samples of ``number`` calls each, ``number`` chosen so one
sample lasts at least ``min_repeat_ms``. The median is the cost; the interquartile range
is the spread. Wall and process CPU time are both kept (CPU time > wall time means
more threads ran than asked for).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Protocol:
    warmup: int = 2
    repeat: int = 7
    min_repeat_ms: float = 50.0
    max_number: int = 1000


@dataclass(frozen=True)
class Measurement:
    """What a runner saw: seconds per call (median), spread, samples; or an error."""

    median_s: float
    spread_s: float
    cpu_s: float
    repeats: int
    number: int
    error: str | None = None
    load: float | None = None  # 1-minute load average at measurement time

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def cost_s(self) -> float:
        return self.median_s if self.ok else float("inf")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def failed(cls, error: str) -> Measurement:
        return cls(float("inf"), 0.0, float("inf"), 0, 0, error)


def time_callable(fn: Callable[[], object], protocol: Protocol = Protocol()) -> Measurement:
    """Time ``fn`` by the protocol. ``fn`` must block until its work is done."""
    for _ in range(protocol.warmup):
        fn()
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    number = max(1, min(protocol.max_number, int(protocol.min_repeat_ms / 1e3 / one)))
    walls, cpus = [], []
    for _ in range(protocol.repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(number):
            fn()
        walls.append((time.perf_counter() - w0) / number)
        cpus.append((time.process_time() - c0) / number)
    q = statistics.quantiles(walls, n=4) if len(walls) > 1 else [walls[0]] * 3
    return Measurement(statistics.median(walls), q[2] - q[0], statistics.median(cpus),
                       protocol.repeat, number, load=os.getloadavg()[0])
