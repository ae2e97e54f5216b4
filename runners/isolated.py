"""Contenders timed apart at more than one thread: a worker process each, one running at a time.

At one thread, contenders share one process and take turns (``time_interleaved``). At
more, a library's idle thread pool (onnxruntime's spinning workers, OpenMP's, TBB's)
keeps burning cores after its call returns, and in one process it slows whichever
contender runs next, so the ratio measures the neighbour, not the contender. Here each
contender gets a worker process of its own, built once; the rounds still alternate
between them (machine drift touches all alike, the start rotating each round), and a
quiet gap before each turn lets the last one's pools fall asleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from partune.runners.protocol import CompareRequest
from partune.runners.runner import Runner
from partune.runners.timing import Measurement, over_rounds

QUIET_S = 0.05  # before each turn: spinning pools (ORT, OpenMP, TBB) park within a few ms


def compare_isolated(
    request: CompareRequest, runner_for: Callable[[], Runner], timeout_s: float | None = None
) -> dict[str, Measurement]:
    """``request``'s contenders, each in its own runner from ``runner_for``, in alternating
    rounds of one turn each. A contender that fails is not tried again."""
    labels = list(request.contenders)
    runners = {label: runner_for() for label in labels}
    rows: dict[str, list[Measurement]] = {label: [] for label in labels}
    try:
        for r in range(request.rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                if rows[label] and not rows[label][-1].ok:
                    continue
                time.sleep(QUIET_S)
                turn = replace(request, contenders={label: request.contenders[label]}, rounds=1)
                rows[label].append(runners[label].compare(turn, timeout_s)[label])
    finally:
        for runner in runners.values():
            runner.close()
    return {label: over_rounds(ms) for label, ms in rows.items()}
