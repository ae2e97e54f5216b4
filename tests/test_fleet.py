"""A fleet on loopback: one TVM RPC tracker, two ``partune rpc-server`` devices under one key,
and three ``partune tune`` processes on one PostgreSQL storage finish one search together.

Loopback devices share this machine's cores, so the timings taken here are only for these
tests (a fresh database each): they never enter a benchmark's store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import optuna
import pytest

from partune.store.measurements import STUDY_PREFIX
from tests.fleet import ENV, ROOT, loopback_fleet
from tests.model_files import write_mlp_onnx

WORKERS = 3


def _tune(model, tracker: str, key: str, url: str, out) -> list[str]:
    return [
        sys.executable,
        "-m",
        "partune.cli",
        "tune",
        str(model),
        "--backends",
        "tvm,onnxruntime",
        "--peers",
        "none",
        "--refine-trials",
        "2",
        "--runner",
        f"rpc://{tracker}/{key}",
        "--storage",
        url,
        "--study",
        "fleet",
        "-o",
        str(out),
    ]


def _measurements(url: str) -> dict[str, list]:
    """Per device study: the stored measurement trials."""
    return {
        s.study_name[len(STUDY_PREFIX) :]: optuna.load_study(
            study_name=s.study_name, storage=url
        ).trials
        for s in optuna.get_all_study_summaries(url)
        if s.study_name.startswith(STUDY_PREFIX)
    }


@pytest.mark.timeout(600)
def test_fleet_three_workers_two_devices_one_postgres_store(tmp_path, postgres_url, capsys):
    model = write_mlp_onnx(tmp_path / "mlp.onnx", layers=4)
    with loopback_fleet({"fleet": 2, "other": 1}) as (tracker, _):
        procs = [
            subprocess.Popen(
                _tune(model, tracker, "fleet", postgres_url, tmp_path / f"plan{i}.json"),
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(WORKERS)
        ]
        outs = [p.communicate(timeout=540) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-800:] for _, err in outs]
        ((device, trials),) = _measurements(postgres_url).items()
        keys = [t.user_attrs["key"] for t in trials]
        assert len(keys) == len(set(keys)), "a key was measured twice"
        # The candidates are the work to share; plans and calibrations are few, taken by whoever
        # gets there first.
        candidates = [t for t in trials if t.user_attrs["key"].startswith("region:")]
        assert {t.user_attrs["pid"] for t in candidates} == {p.pid for p in procs}, (
            "every worker measured"
        )
        # (1/N) +- 20% of the keys each, counted from when the last worker to start stored its
        # first: until then the others worked alone (start-up skews on a loaded machine; one CI
        # run counted 21 / 15 / 15 of 51 from the start; here, 16-17 each of 48-49 together).
        first = {
            pid: min(t.datetime_start for t in candidates if t.user_attrs["pid"] == pid)
            for pid in {p.pid for p in procs}
        }
        together = [t for t in candidates if t.datetime_start >= max(first.values())]
        share = Counter(t.user_attrs["pid"] for t in together)
        assert len(together) >= 5 * WORKERS, (len(together), len(candidates))
        for n in share.values():
            assert abs(n / len(together) - 1 / WORKERS) <= 0.2 / WORKERS, (
                share,
                len(together),
                len(candidates),
            )
        # `partune status` shows the fleet: the device, its rate, every worker that measured.
        from partune.cli import main

        assert main(["status", "--storage", postgres_url]) == 0
        status = capsys.readouterr().out
        assert "measuring in the last" in status and device in status
        assert all(f":{p.pid} (" in status for p in procs), status
        # A single worker from the same store measures nothing and emits the same plan.
        single = subprocess.run(
            _tune(model, tracker, "fleet", postgres_url, tmp_path / "single.json"),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert single.returncode == 0, single.stderr[-800:]
        assert "measurements made 0 (0 failed)" in single.stdout
        regions = json.loads((tmp_path / "single.json").read_text())["regions"]
        assert json.loads((tmp_path / f"plan{WORKERS - 1}.json").read_text())["regions"] == regions
        # A device under another key keeps its own fingerprint, so its own measurements.
        from partune.runners.rpc import RPCRunner

        assert (
            RPCRunner(tracker, "other").device()
            not in (device, RPCRunner(tracker, "fleet").device())
            and RPCRunner(tracker, "fleet").device() == device
        )
    studies = _measurements(postgres_url)
    assert list(studies) == [device] and len(studies[device]) == len(keys)
    assert all(t.state != optuna.trial.TrialState.RUNNING for ts in studies.values() for t in ts)


@pytest.fixture
def slow_backend():
    from partune.backends import registry

    registry.register(
        "slow", "tests.crash_backend:SlowBackend"
    )  # travels to the servers in the settings
    yield
    registry.unregister("slow")


def test_fleet_a_device_killed_mid_measurement_is_retried_on_the_other(tmp_path, slow_backend):
    from partune.core.graph import DataflowGraph
    from partune.core.scopes import CompilationConfig
    from partune.runners.builder import region_request
    from partune.runners.rpc import RPCRunner
    from tests.graphs import Chain

    log = tmp_path / "builds.log"
    log.touch()
    with loopback_fleet({"fleet": 2}, env={"SLOW_LOG": str(log), "SLOW_BUILD_S": "4"}) as (
        tracker,
        _,
    ):
        runner = RPCRunner(tracker, "fleet", timeout_s=120)
        request = region_request(
            Chain,
            DataflowGraph.from_function(Chain["main"]),
            (0,),
            CompilationConfig.for_cpu(["slow"]).scope_for("slow"),
        )
        done: dict = {}
        thread = threading.Thread(target=lambda: done.update(m=runner.run(request)))
        thread.start()
        deadline = time.monotonic() + 120
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        first = int(log.read_text().split()[0])
        os.killpg(first, signal.SIGKILL)  # the device that took the request, mid-build
        thread.join(timeout=180)
    builders = log.read_text().split()
    assert done["m"].ok, done["m"].error
    assert len(builders) == 2 and builders[1] != builders[0]  # measured again, on the other device
