"""MetaSchedule tuning of single regions: faster kernels, reuse, resume after SIGKILL, errors.

One small tuning run (a 256x256 matmul + relu, 16 trials, about 30 s on 2 cores) is
shared by the tests of a module-scoped database.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from partune.backends import registry
from partune.backends.base import BackendError, Level
from partune.backends.tvm_backend import TvmBackend, region_module
from partune.backends.tvm_tuned_backend import TunedTvmBackend
from partune.backends.tvm_tuning import budget_shares, tune_region
from partune.backends.tvm_tuning_database import (
    RECORD_FILE,
    STATE_FILE,
    TuningError,
    database_path,
    target_json,
)
from partune.core.scopes import SEScope, cpu_target
from partune.runners.timing import Protocol, time_callable

# One test process runs this module under ``make test`` (pytest-xdist): ``tuned`` tunes for 30 s.
pytestmark = pytest.mark.xdist_group("tvm_tuning")

ROOT = Path(__file__).resolve().parents[1]
N = 256
TRIALS = 16
SCOPE = SEScope("cpu", 0, cpu_target(1), "global", "tvm-tuned")
TARGET = SCOPE.tvm_target()


def weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((N, N)).astype("float32")


def matmul_relu(name: str = "region", seed: int = 0) -> relax.Function:
    """A region as the search lifts one: a tensor param, weights as a constant."""
    x = relax.Var(f"{name}_x", relax.TensorType((N, N), "float32"))
    w = relax.const(weight(seed))
    bb = relax.BlockBuilder()
    with bb.function(name, [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()[name]


def _records(database_dir: Path) -> int:
    """Complete record lines in the database of TARGET."""
    file = Path(database_path(str(database_dir), TARGET)) / RECORD_FILE
    return file.read_bytes().count(b"\n") if file.exists() else 0


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database holding the matmul region tuned with TRIALS trials, and that run's report."""
    database = tmp_path_factory.mktemp("tuning")
    report = tune_region(matmul_relu(), TARGET, str(database), TRIALS)
    return database, report


def test_first_call_tunes_the_task(tuned):
    database, report = tuned
    (task,) = report.tasks
    assert task.name == "fused_matmul_relu" and task.status == "tuned"
    assert task.share == TRIALS and task.records_before == 0
    assert report.trials_run == task.trials_run == TRIALS and report.tasks_reused == 0
    assert task.best_s is not None and task.best_s > 0 and not report.timed_out
    assert _records(database) == TRIALS


def _best_ms(kernel, x, out) -> float:
    return time_callable(lambda: kernel(x, out), Protocol(repeat=5, min_repeat_ms=20)).cost_s * 1e3


def test_tuned_region_is_faster_and_correct(tuned):
    database, _ = tuned
    func = matmul_relu()
    x_np = np.random.default_rng(1).standard_normal((N, N)).astype("float32")
    ref = np.maximum(x_np @ weight(), 0)
    x = tvm.runtime.tensor(x_np)
    kernels = {}
    for label, backend in (("untuned", TvmBackend()), ("tuned", TunedTvmBackend(str(database)))):
        kernels[label] = backend.build_region(func, SCOPE, 1)
        out = tvm.runtime.tensor(np.zeros((N, N), "float32"))
        kernels[label](x, out)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-3)
    out = tvm.runtime.tensor(np.zeros((N, N), "float32"))
    ms = {label: [] for label in kernels}
    for _ in range(2):  # interleaved: a burst of load on this shared machine hits both
        for label, kernel in kernels.items():
            ms[label].append(_best_ms(kernel, x, out))
    untuned, tuned_ms = min(ms["untuned"]), min(ms["tuned"])
    # Measured here: 14-48 ms untuned vs 0.8-2.5 ms tuned (17-19x, depending on load).
    assert tuned_ms < untuned / 4, f"tuned {tuned_ms:.2f} ms vs untuned {untuned:.2f} ms"


def test_second_call_reuses_the_task(tuned):
    database, first = tuned
    start = time.monotonic()
    again = tune_region(matmul_relu(), TARGET, str(database), TRIALS)
    assert again.trials_run == 0 and again.tasks_reused == 1
    assert again.tasks[0].reused and again.tasks[0].records_before == TRIALS
    assert again.tasks[0].best_s == first.tasks[0].best_s
    # A structurally equal region from another function (other names, other weights).
    other = tune_region(matmul_relu("elsewhere", seed=7), TARGET, str(database), TRIALS)
    assert other.trials_run == 0 and other.tasks_reused == 1
    assert other.tasks[0].workload == first.tasks[0].workload
    # A smaller budget is covered by what is there; nothing is tuned either.
    assert tune_region(matmul_relu(), TARGET, str(database), 4).trials_run == 0
    assert time.monotonic() - start < 10
    assert _records(database) == TRIALS


def test_tuned_regions_stay_inline_and_main_gets_the_tuned_schedules(tuned, backend_settings):
    """No offload (a VM hand-off per region would cost more than tuning wins on glue):
    the regions stay in main, which the tuned backend builds with the database."""
    from partune.core.graph import DataflowGraph
    from partune.core.scopes import CompilationConfig
    from partune.runners.builder import build_plan, main_compiler
    from partune.search.candidates import backend_plan

    database, _ = tuned
    backend_settings(tuning_database=str(database))
    func = matmul_relu("main")
    mod = region_module(func)
    graph = DataflowGraph.from_function(mod["main"])
    config = CompilationConfig.for_cpu(["tvm-tuned"])
    plan = backend_plan("matmul", mod, graph, config, "tvm-tuned")
    untuned = backend_plan("matmul", mod, graph, config, "tvm")
    assert main_compiler(plan).name == "tvm-tuned" and main_compiler(untuned).name == "tvm"
    built = build_plan(plan, mod, graph)
    assert not [
        f for _, f in built.module.functions.items() if f.attrs is not None and "Codegen" in f.attrs
    ]
    x = np.random.default_rng(2).standard_normal((N, N)).astype("float32")
    np.testing.assert_allclose(built([x])[0], np.maximum(x @ weight(), 0), rtol=1e-4, atol=1e-3)
    slow = build_plan(untuned, mod, graph)
    fast_ms = time_callable(built.prepare([x])).cost_s
    assert fast_ms < time_callable(slow.prepare([x])).cost_s / 4


def test_resumes_after_sigkill(tmp_path):
    """Kill a tuning process once the database holds a record; the rerun continues from there."""
    module = tmp_path / "region.json"
    module.write_text(tvm.ir.save_json(region_module(matmul_relu())))
    database = tmp_path / "db"
    cmd = [
        sys.executable,
        "-m",
        "partune.backends.tvm_tuning",
        "--module",
        str(module),
        "--target",
        json.dumps(target_json(TARGET)),
        "--database",
        str(database),
        "--trials",
        "16",
        "--trials-per-iter",
        "4",
    ]
    # Its own session: the kill takes MetaSchedule's builder and runner processes too.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while _records(database) == 0:
            assert proc.poll() is None, "tuning ended before it could be killed"
            assert time.monotonic() < deadline, "no record within 120 s"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = _records(database)
    assert 1 <= kept < 16
    # A kill in the middle of a write leaves a partial line; MetaSchedule alone would
    # refuse the whole file.
    with open(Path(database_path(str(database), TARGET)) / RECORD_FILE, "ab") as f:
        f.write(b'[0, [[["GetSBlock"')
    budget = kept + 4  # the rerun owes the task only what the killed run did not do
    report = tune_region(matmul_relu(), TARGET, str(database), budget, trials_per_iter=4)
    (task,) = report.tasks
    assert task.records_before == kept and task.trials_run == budget - kept == 4
    assert task.status == "tuned" and _records(database) == budget


def test_timeout_keeps_the_batch_in_flight(tmp_path):
    """Past the deadline tuning stops after the batch it is measuring, and keeps it."""
    report = tune_region(matmul_relu(), TARGET, str(tmp_path), 16, timeout_s=0.1, trials_per_iter=4)
    (task,) = report.tasks
    assert report.timed_out and task.status == "partial"
    assert task.trials_run == 4 and _records(tmp_path) == 4
    # Not marked as done: the next call goes on tuning it.
    assert not (Path(report.database) / STATE_FILE).exists()


def test_errors_are_tuning_errors(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(TuningError) as info:
        tune_region(matmul_relu(), TARGET, str(not_a_dir), 4)
    assert "\n" not in str(info.value)
    # The same from a child process: its failure comes back as the same exception.
    with pytest.raises(TuningError) as info:
        tune_region(matmul_relu(), TARGET, str(not_a_dir), 4, isolate=True)
    assert "\n" not in str(info.value)


def test_tuned_backend_needs_a_database():
    backend = TunedTvmBackend()  # constructing it (listing the backends) is fine
    with pytest.raises(BackendError, match="tuning_database"):
        backend.build_region(matmul_relu(), SCOPE, 1)


def test_tuned_backend_is_registered_but_not_offered_by_default():
    assert "tvm-tuned" in registry.names()
    cls = TunedTvmBackend
    assert not cls.offered_by_default and TvmBackend.offered_by_default
    assert cls.level is Level.NATIVE and cls.fusion_style.value == "tvm" and cls.autotuned
    assert set(cls.device_types) == {"cpu", "cuda"}
    assert TunedTvmBackend("/nowhere").codegen is None  # inline in main, like native TVM


def test_budget_shares():
    assert budget_shares([1.0], 16) == [16]
    assert budget_shares([32768.0, 4235264.0], 32) == [4, 28]  # softmax beside a matmul
    for work in ([1.0, 2.0, 3.0], [0.0, 0.0], [5.0, 1e9, 7.0]):
        for total in (0, 1, 2, 7, 64):
            shares = budget_shares(work, total)
            assert sum(shares) == total and min(shares) >= 0
