"""Bounded memory: workers replaced before they grow, kernels released, OOM kills survived,
peaks reported (``partune.runners.local``, ``partune.runners.memory``)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import tvm
import tvm_ffi

from partune.backends import registry
from partune.backends.tvm_backend import TvmBackend
from partune.commands.summary import memory_line
from partune.core.graph import DataflowGraph
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig
from partune.runners import memory, worker
from partune.runners.build_pool import BuildPool, available_cpus
from partune.runners.builder import compare_request, plan_request, region_request
from partune.runners.local import LocalRunner
from partune.search.candidates import backend_plan
from partune.search.result import MemoryPeaks
from tests.graphs import Chain, Diamond

CHAIN = DataflowGraph.from_function(Chain["main"])
FAST = {"warmup": 1, "warmup_ms": 1.0, "repeat": 2, "min_repeat_ms": 1.0}
TVM = CompilationConfig.for_cpu(["tvm"], 1).scope_for("tvm")
MiB = 1 << 20


class SigkillBackend(TvmBackend):
    """TVM whose builds end their own process with SIGKILL, as the out-of-memory killer would."""

    name = "sigkill"

    def build_region(self, func, scope, threads):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def sigkill():
    registry.register("sigkill", "tests.test_memory:SigkillBackend")
    yield CompilationConfig.for_cpu(["sigkill"], 1).scope_for("sigkill")
    registry.unregister("sigkill")


def _region(nodes: tuple[int, ...] = (0, 1), scope=TVM):
    return region_request(Chain, CHAIN, nodes, scope, FAST)


def _measures(runner: LocalRunner, nodes: tuple[int, ...] = (0, 1)) -> None:
    m = runner.run(_region(nodes))
    assert m.ok and 0 < m.median_s < 1.0, m


def test_a_worker_is_replaced_after_its_number_of_requests():
    with LocalRunner(timeout_s=300, max_requests=2, max_rss_bytes=None) as runner:
        _measures(runner)
        first = runner.pid
        _measures(runner, (0, 1, 2))
        assert runner.recycled == 1 and runner.pid != first  # the next one started at once
        second = runner.pid
        _measures(runner)
        assert runner.pid == second and runner.recycled == 1
        assert runner.peak_rss_bytes > 50 * MiB  # each worker has TVM loaded
    with LocalRunner(timeout_s=300, max_requests=None, max_rss_bytes=None) as runner:
        for nodes in ((0, 1), (0, 1, 2), (0,)):
            _measures(runner, nodes)
        assert runner.recycled == 0  # no limits: one worker for everything


def test_a_worker_above_the_size_limit_is_replaced_and_results_stay_right():
    with LocalRunner(timeout_s=300, max_requests=None, max_rss_bytes=1) as runner:
        _measures(runner)
        first = runner.pid
        assert runner.recycled == 1 and first is not None and runner.rss_bytes > 50 * MiB
        _measures(runner, (0, 1, 2))  # on the fresh worker
        assert runner.recycled == 2 and runner.pid not in (first, None)
        assert runner.peak_rss_bytes > 50 * MiB


def test_a_worker_killed_with_sigkill_costs_one_request(sigkill):
    with LocalRunner(timeout_s=300) as runner:
        _measures(runner)
        first = runner.pid
        killed = runner.run(_region(scope=sigkill))
        assert not killed.ok and "worker crashed (signal SIGKILL)" in killed.error
        assert runner.pid is None and runner.recycled == 0  # a crash, not a recycling
        _measures(runner)  # a fresh worker takes the next request
        assert runner.pid not in (first, None)


def test_the_build_pool_recycles_and_survives_a_sigkill(tmp_path, sigkill):
    cache = str(tmp_path / "cache")
    reqs = [_region(scope=sigkill), _region((0, 1)), _region((0, 1, 2))]
    with BuildPool(
        cache, workers=1, cpus=available_cpus(), timeout_s=300, max_builds=1, max_rss_bytes=None
    ) as pool:
        pool.prefetch(reqs)
        assert pool.stats["queued"] == 3 and pool.join(300)
        assert pool.stats["failed"] == 1 and pool.stats["stored"] == 2, (pool.stats, pool.errors)
        assert "SIGKILL" in pool.errors[0]
        assert pool.recycled == 2  # after each good build; the killed worker is not counted
        assert pool.peak_rss_bytes > 50 * MiB


def test_an_isolated_comparison_is_not_recycled_between_its_rounds(monkeypatch):
    plans = {
        f"{b}-only": backend_plan("chain", Chain, CHAIN, CompilationConfig.for_cpu([b], 2), b)
        for b in ("tvm", "onnxruntime")
    }
    request = compare_request(
        tvm.ir.save_json(Chain), plans, {}, [np.ones((64, 64), "float32")], rounds=3
    )
    spawned: list[int] = []
    spawn = LocalRunner._spawn

    def counted(self) -> None:
        spawn(self)
        spawned.append(self.pid)

    monkeypatch.setattr(LocalRunner, "_spawn", counted)
    with LocalRunner(timeout_s=300, threads=2, max_requests=1, max_rss_bytes=1) as runner:
        got = runner.compare(request)
    assert all(m.ok for m in got.values()), got
    assert len(spawned) == 2  # one worker per contender for all three rounds, limits or not
    assert runner.peak_rss_bytes > 50 * MiB  # the contenders' workers' peaks count


def test_a_plan_built_in_a_worker_leaves_no_kernel_registered():
    config = CompilationConfig.for_cpu(["tvm", "onnxruntime"], 1)
    graph = DataflowGraph.from_function(Diamond["main"])
    plan = single_backend_plan("diamond", graph, config, "onnxruntime", set(range(len(graph))))
    before = set(tvm_ffi.registry.list_global_func_names())
    inputs = [np.ones((4, 4), "float32")]
    reply = worker.handle(plan_request(tvm.ir.save_json(Diamond), plan, inputs, FAST))
    assert reply.measurement.ok, reply
    assert not [
        n
        for n in set(tvm_ffi.registry.list_global_func_names()) - before
        if n.startswith("partune_")
    ]
    assert (
        worker.handle(
            compare_request(tvm.ir.save_json(Diamond), {"ort": plan}, {}, inputs, rounds=1)
        )
        .measurements["ort"]
        .ok
    )
    assert worker._CURRENT  # kept for the comparison's next round ...
    worker.handle(_region())
    assert not worker._CURRENT  # ... released by the next request of another kind


def test_the_lifetime_peak_survives_a_reset():
    if memory.peak_bytes() is None:
        pytest.skip("no /proc/self/status here")
    block = np.ones(128 * MiB // 8)  # touched: resident
    del block
    memory.trim()
    assert memory.reset_peak()
    assert memory.lifetime_peak_bytes() - memory.peak_bytes() > 64 * MiB


def test_the_summary_line_says_each_process_peak():
    peaks = MemoryPeaks(
        search=1_230_000_000,
        measuring=900_000_000,
        measuring_recycled=3,
        build_pool=700_000_000,
        build_pool_recycled=1,
    )
    assert memory_line(peaks) == (
        "peak memory: search 1.2 GB, measuring workers 0.9 GB (recycled 3 times), "
        "build pool 0.7 GB (recycled 1 time)"
    )
    assert memory_line(MemoryPeaks(search=2_000_000_000)) == "peak memory: search 2.0 GB"

    class Runner:
        peak_rss_bytes, recycled = 5 * MiB, 4

    got = MemoryPeaks.of(Runner(), None)
    assert got.search > 50 * MiB and (got.measuring, got.measuring_recycled, got.build_pool) == (
        5 * MiB,
        4,
        0,
    )
