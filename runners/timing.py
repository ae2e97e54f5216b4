"""The timing protocol every measurement in Partune follows, so numbers compare.

Warm-up (``warmup`` calls and at least ``warmup_ms``), then ``repeat`` samples of
``number`` calls each, ``number`` chosen so one sample lasts at least ``min_repeat_ms``.
The median and the interquartile range are reported. The search compares *costs*, which
are the fastest sample: on shared machines noise only ever adds time, and the minimum
of samples varied 3x less than the median between back-to-back runs here (bert-small,
0.165-0.175 ms vs 0.174-0.223 ms). Wall and process CPU time are both kept (CPU time
above wall time means more threads ran than asked for).
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
    warmup_ms: float = 50.0
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
    best_s: float | None = None  # fastest sample
    peak_bytes: int | None = None  # resident memory the build and the runs added (whole plans)
    # A plan with bf16 regions: its largest relative error against the same plan in f32
    # (``partune.runners.accuracy``); None for f32 plans, which compute as the model does.
    rel_error: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def cost_s(self) -> float:
        """What the search compares: the fastest sample (+inf when it failed)."""
        if not self.ok:
            return float("inf")
        return self.best_s if self.best_s is not None else self.median_s

    def to_json(self) -> dict:
        """Every field; ``rel_error`` only where there is one (f32 measurements read as before)."""
        doc = asdict(self)
        if doc["rel_error"] is None:
            del doc["rel_error"]
        return doc

    @classmethod
    def failed(cls, error: str) -> Measurement:
        return cls(float("inf"), 0.0, float("inf"), 0, 0, error)


def _iqr(samples: list[float]) -> float:
    """Interquartile range (0 for a single sample)."""
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    return q[2] - q[0]


def time_callable(fn: Callable[[], object], protocol: Protocol = Protocol()) -> Measurement:
    """Time ``fn`` by the protocol. ``fn`` must block until its work is done."""
    start = time.perf_counter()
    calls = 0
    while calls < protocol.warmup or time.perf_counter() - start < protocol.warmup_ms / 1e3:
        fn()
        calls += 1
    one = max((time.perf_counter() - start) / calls, 1e-7)
    number = max(1, min(protocol.max_number, int(protocol.min_repeat_ms / 1e3 / one)))
    walls, cpus = [], []
    for _ in range(protocol.repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(number):
            fn()
        walls.append((time.perf_counter() - w0) / number)
        cpus.append((time.process_time() - c0) / number)
    return Measurement(
        statistics.median(walls),
        _iqr(walls),
        statistics.median(cpus),
        protocol.repeat,
        number,
        load=os.getloadavg()[0],
        best_s=min(walls),
    )


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int = 5,
    protocol: Protocol = Protocol(warmup_ms=20.0, repeat=3, min_repeat_ms=20.0),
) -> dict[str, Measurement]:
    """Time several contenders in rounds, each round every contender once, in turn.

    Drift of the machine (a neighbour's load, frequency changes) then touches all of
    them alike, which is what makes their ratios fair. Per contender: the median over
    rounds of each round's fastest repeat (``over_rounds``), their IQR, and the fastest
    sample of any round.
    """
    rows: dict[str, list[Measurement]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            rows[label].append(time_callable(fn, protocol))
    return {label: over_rounds(ms) for label, ms in rows.items()}


def over_rounds(ms: list[Measurement]) -> Measurement:
    """One contender's rounds as one measurement: the median over rounds of each round's
    fastest repeat, their IQR, and the fastest sample of any round (a failed round fails it).

    Each repeat already averages at least ``min_repeat_ms`` of calls, so whatever a
    contender costs on every call (its own threads waking, copies at its borders) is in
    every repeat; the fastest of a round's repeats drops only a repeat that something
    else on the machine interrupted. On a loaded 2-core machine, round medians were 1.5x
    the fastest samples and more, and they decided the verdict: mobilenet_v3_small's
    plan was 0.93x the best peer by round medians, 1.13x by fastest samples, and 1.14x by
    round medians once the machine was quiet. The median over rounds keeps one lucky
    round from deciding.
    """
    if failed := next((m for m in ms if not m.ok), None):
        return failed
    bests = [m.cost_s for m in ms]
    errors = [
        m.rel_error for m in ms if m.rel_error is not None
    ]  # a bf16 contender's, each round's alike
    peaks = [m.peak_bytes for m in ms if m.peak_bytes is not None]
    return Measurement(
        statistics.median(bests),
        _iqr(bests),
        statistics.median(m.cpu_s for m in ms),
        sum(m.repeats for m in ms),
        ms[0].number,
        load=os.getloadavg()[0],
        best_s=min(m.cost_s for m in ms),
        peak_bytes=max(peaks) if peaks else None,
        rel_error=max(errors) if errors else None,
    )
