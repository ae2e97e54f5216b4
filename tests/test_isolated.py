"""Contenders timed apart at more than one thread (``partune.runners.isolated``)."""

from __future__ import annotations

import numpy as np
import tvm

from partune.core.graph import DataflowGraph
from partune.core.scopes import CompilationConfig
from partune.runners.builder import compare_request
from partune.runners.isolated import compare_isolated
from partune.runners.local import LocalRunner
from partune.runners.protocol import ErrorReply, MeasurementsReply
from partune.runners.runner import Runner
from partune.runners.timing import Measurement
from partune.search.candidates import backend_plan
from tests.graphs import Chain

GRAPH = DataflowGraph.from_function(Chain["main"])
INPUTS = [np.ones((64, 64), "float32")]


def _plans(threads: int) -> dict:
    return {
        f"{b}-only": backend_plan("chain", Chain, GRAPH, CompilationConfig.for_cpu([b], threads), b)
        for b in ("tvm", "onnxruntime")
    }


class Recording(Runner):
    """Answers every turn with a measurement; remembers what it was sent."""

    log: list = []

    def __init__(self, fail: str | None = None) -> None:
        self.fail, self.closed = fail, False
        self.turns: list = []

    def exchange(self, request, timeout_s=None):
        (label,) = request.contenders
        self.turns.append((label, request.rounds))
        Recording.log.append(label)
        if label == self.fail:
            return ErrorReply("worker crashed")
        return MeasurementsReply(
            {label: Measurement(1e-3 * (1 + len(self.turns)), 0.0, 1e-3, 1, 1)}
        )

    def close(self) -> None:
        self.closed = True


def test_each_contender_has_a_runner_of_its_own_and_turns_alternate():
    request = compare_request(
        tvm.ir.save_json(Chain),
        _plans(2),
        {"peer": {"kind": "unavailable", "why": "-"}},
        INPUTS,
        rounds=4,
    )
    made: list[Recording] = []
    Recording.log = []

    def runner_for() -> Recording:
        made.append(Recording(fail="peer"))
        return made[-1]

    got = compare_isolated(request, runner_for)
    assert len(made) == 3 and all(r.closed for r in made)
    for runner in made:  # one contender per runner, one round per turn
        assert len({label for label, _ in runner.turns}) == 1 and {n for _, n in runner.turns} == {
            1
        }
    labels = list(request.contenders)
    assert Recording.log[:3] == labels and Recording.log[3] == labels[1]  # the start rotates
    assert (
        Recording.log.count("peer") == 1 and got["peer"].error == "worker crashed"
    )  # not tried again
    plans = [r for r in made if r.fail not in {label for label, _ in r.turns}]
    # the median of the four turns' medians (2, 3, 4, 5 ms)
    assert all(got[r.turns[0][0]].median_s == 3.5e-3 for r in plans)


def test_a_local_runner_isolates_contenders_at_two_threads():
    request = compare_request(tvm.ir.save_json(Chain), _plans(2), {}, INPUTS, rounds=2)
    with LocalRunner(timeout_s=300, threads=2) as runner:
        got = runner.compare(request)
        assert runner.pid is None  # its own worker never started: each contender had one
    assert set(got) == {"tvm-only", "onnxruntime-only"} and all(m.ok for m in got.values())


def test_rounds_keep_a_contenders_error_and_peak():
    """Timed apart (at more than one thread), a bf16 peer's error against f32 must survive its
    rounds: the verdict marks a peer over the budget by it (it read as missing, and the
    benchmark's table as nan)."""
    from partune.runners.timing import Measurement, over_rounds

    rounds = [
        Measurement(t, 0, t, 3, 10, rel_error=2e-2, peak_bytes=p)
        for t, p in ((3e-3, 5), (2e-3, 7), (4e-3, 6))
    ]
    one = over_rounds(rounds)
    assert (
        one.median_s == 3e-3
        and one.best_s == 2e-3
        and one.rel_error == 2e-2
        and one.peak_bytes == 7
    )
    assert over_rounds([Measurement(1e-3, 0, 1e-3, 1, 1)]).rel_error is None
