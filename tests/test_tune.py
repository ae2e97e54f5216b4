"""The search end to end: resume after SIGKILL, crashing and hanging kernels, RPC."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from partune.backends import registry
from partune.cli import main
from partune.core.graph import DataflowGraph
from partune.core.plan import Plan
from partune.core.scopes import CompilationConfig
from partune.runners.build_pool import split_cores
from partune.runners.builder import region_request
from partune.runners.local import LocalRunner
from partune.runners.timing import Measurement
from partune.store.measurements import STUDY_PREFIX
from tests.graphs import Chain

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def chain_file(tmp_path):
    path = tmp_path / "chain.py"
    path.write_text(
        "from tvm.script import ir as I\nfrom tvm.script import relax as R\n" + Chain.script()
    )
    return path


def _trials(url: str):
    name = next(
        s.study_name
        for s in optuna.get_all_study_summaries(url)
        if s.study_name.startswith(STUDY_PREFIX)
    )
    return optuna.load_study(study_name=name, storage=url).get_trials()


def _count_trials(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as con:
            return con.execute("select count(*) from trials").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def _tune_cmd(model: Path, url: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "partune.cli",
        "tune",
        str(model),
        "--backends",
        "tvm",
        "--peers",
        "none",
        "--storage",
        url,
        "-o",
        str(out),
    ]


def test_sigkill_then_resume_remeasures_nothing(tmp_path, chain_file):
    db = tmp_path / "m.db"
    url = f"sqlite:///{db}"
    out = tmp_path / "plan.json"
    proc = subprocess.Popen(
        _tune_cmd(chain_file, url, out),
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while _count_trials(db) < 6 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.user_attrs["key"] for t in _trials(url)}
    assert len(before) >= 6 and not out.exists()

    done = subprocess.run(_tune_cmd(chain_file, url, out), cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    keys = [t.user_attrs["key"] for t in _trials(url)]
    assert len(keys) == len(set(keys)), "something was measured twice"
    assert before < set(keys)
    plan1 = out.read_text()
    if split_cores()[1]:  # a core to spare: the candidates left were built ahead by the pool
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith("build pool on core(s)"))
        assert re.search(r": [1-9]\d* region\(s\) built ahead, .*, 0 failed", line), line

    again = subprocess.run(
        _tune_cmd(chain_file, url, out), cwd=ROOT, capture_output=True, text=True
    )
    assert again.returncode == 0
    assert "measurements made 0 (0 failed)" in again.stdout
    phases = dict(
        re.findall(
            r"(?:: |; )([^;]+?) (\d+\.\d) s",
            next(ln for ln in again.stdout.splitlines() if ln.startswith("time by phase: ")),
        )
    )
    assert "start-up (imports, model, store)" in phases and "measure candidates" in " ".join(phases)
    assert out.read_text() == plan1


@pytest.fixture
def crash_backends():
    # Registered backends join the settings every request carries to the worker processes.
    registry.register("segfault", "tests.crash_backend:SegfaultBackend")
    registry.register("hang", "tests.crash_backend:HangBackend")
    yield
    registry.unregister("segfault")  # later tests that use every backend must not get these
    registry.unregister("hang")


def test_crashing_kernel_costs_one_candidate(tmp_path, chain_file, crash_backends, capsys):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "tune",
                str(chain_file),
                "--backends",
                "tvm,segfault",
                "--peers",
                "none",
                "--storage",
                url,
                "-o",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "partune dp" in text
    failed = [t for t in _trials(url) if t.state == optuna.trial.TrialState.FAIL]
    assert failed and all("SIGSEGV" in t.user_attrs["m"]["error"] for t in failed)
    regions = json.loads(out.read_text())["regions"]
    assert regions and all(
        r["scope"]["backend"] != "segfault" for r in regions
    )  # never the crasher


def test_hanging_kernel_times_out_and_the_runner_recovers(crash_backends):
    g = DataflowGraph.from_function(Chain["main"])
    cfg = CompilationConfig.for_cpu(["hang"])
    with LocalRunner(timeout_s=3) as runner:
        hung = runner.run(region_request(Chain, g, (0,), cfg.scope_for("hang")))
        assert not hung.ok and "timed out" in hung.error
        runner.timeout_s = 120  # a first TVM build in a fresh worker may take seconds
        fine = runner.run(region_request(Chain, g, (0, 1), cfg.scope_for("tvm")))
        assert fine.ok and fine.median_s > 0


def test_rpc_runner_against_loopback_tracker_and_server():
    from partune.runners.rpc import RPCRunner
    from tests.fleet import loopback_fleet

    with loopback_fleet({"cpu-test": 1}) as (tracker, _):
        runner = RPCRunner(tracker, "cpu-test", timeout_s=60)
        g = DataflowGraph.from_function(Chain["main"])
        scope = CompilationConfig.for_cpu(["tvm"]).scope_for("tvm")
        m = runner.run(region_request(Chain, g, (0, 1, 2), scope))
        assert m.ok and 0 < m.median_s < 0.1, m
        # Measurements are stored under the servers' fingerprint and key, not this process's.
        from partune.core.versions import device_fingerprint

        assert runner.device() != device_fingerprint(runner.threads)


def test_unreachable_tracker_is_a_clear_error(capsys, chain_file):
    from tests.fleet import free_port

    port = free_port()
    assert (
        main(
            [
                "tune",
                str(chain_file),
                "--runner",
                f"rpc://127.0.0.1:{port}/k",
                "--storage",
                "sqlite:///:memory:",
            ]
        )
        == 2
    )
    assert "cannot reach RPC tracker" in capsys.readouterr().err


def test_tvm_region_builds_with_a_tuning_database(tmp_path, backend_settings):
    """With a database, TVM's tuning pipeline runs first; the region's main must survive it.
    The setting travels inside the request, as it does to a worker process."""
    from dataclasses import replace

    from partune.backends.settings import Settings
    from partune.runners.worker import handle

    g = DataflowGraph.from_function(Chain["main"])
    req = region_request(Chain, g, (0, 1, 2), CompilationConfig.for_cpu(["tvm"]).scope_for("tvm"))
    reply = handle(replace(req, settings=Settings(tvm_database=str(tmp_path))))
    assert reply.measurement.error is None, reply
    assert registry.get("tvm").database_dir == str(tmp_path)


def test_finalists_meet_onnxruntime_on_the_users_file(tmp_path, capsys):
    """The verdict: plans and the user's own ONNX file in onnxruntime, one process, interleaved."""
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url = f"sqlite:///{tmp_path / 'm.db'}"
    out = tmp_path / "plan.json"
    args = [
        "tune",
        str(model),
        "--backends",
        "tvm,onnxruntime",
        "--peers",
        "onnxruntime",
        "--storage",
        url,
        "-o",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "(peer) onnxruntime (your .onnx file)" in text
    notes = json.loads(out.read_text())["notes"]
    assert notes["best_peer"] == "onnxruntime (your .onnx file)"
    medians = notes["verdict_median_s"]
    assert notes["speedup_vs_best_peer"] == pytest.approx(
        medians[notes["best_peer"]] / medians[notes["chosen_as"]]
    )
    assert set(notes["verdict_median_s"]) >= {"onnxruntime (your .onnx file)", notes["chosen_as"]}
    assert notes["dp_estimate_s"] > 0 and "DP estimate" in text  # predicted before it was measured
    # A second run takes the verdict from the store too.
    assert main(args) == 0
    assert "measurements made 0 (0 failed)" in capsys.readouterr().out


def test_unknown_peer_is_a_clear_error(capsys, chain_file):
    assert (
        main(["tune", str(chain_file), "--peers", "tensorflow", "--storage", "sqlite:///:memory:"])
        == 2
    )
    assert "unknown peer" in capsys.readouterr().err


def test_refinement_runs_in_the_same_storage_and_never_loses_to_the_dp_plan(tmp_path, capsys):
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url = f"sqlite:///{tmp_path / 'm.db'}"
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "tune",
                str(model),
                "--backends",
                "tvm,onnxruntime",
                "--peers",
                "none",
                "--refine-trials",
                "5",
                "--storage",
                url,
                "-o",
                str(out),
            ]
        )
        == 0
    )
    studies = {s.study_name: s for s in optuna.get_all_study_summaries(url)}
    refine = [s for name, s in studies.items() if name.startswith("refine:")]
    assert len(refine) == 1 and refine[0].n_trials == 5
    e2e = json.loads(out.read_text())["notes"]["end_to_end_s"]
    # The DP plan is the study's first trial: a variant is kept only when it measured faster.
    assert e2e.get("partune refined", 0.0) <= e2e["partune dp"]


def test_two_workers_and_the_memory_objective_from_the_command_line(tmp_path, capsys):
    """--workers 2 shares one search (no measurement taken twice); NSGA-II reports a front.
    On SQLite: workers sharing PostgreSQL are test_fleet's (three of them, two devices)."""
    from partune.store.measurements import STUDY_PREFIX
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url, out = f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "plan.json"
    assert (
        main(
            [
                "tune",
                str(model),
                "--backends",
                "tvm,onnxruntime",
                "--peers",
                "none",
                "--n-trials",
                "6",
                "--workers",
                "2",
                "--objective",
                "latency+memory",
                "--storage",
                url,
                "-o",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "worker " in text and "Pareto front" in text
    notes = json.loads(out.read_text())["notes"]
    assert notes["pareto_front"] and all(f["peak_bytes"] > 0 for f in notes["pareto_front"])
    fastest = Plan.load(str(tmp_path / "plan.front1.json"))  # the front's fastest point, as a plan
    assert list(fastest.backends) == notes["pareto_front"][0]["backends"]
    assert len(fastest.regions) == notes["pareto_front"][0]["regions"]
    studies = {s.study_name: s for s in optuna.get_all_study_summaries(url)}
    store = next(name for name in studies if name.startswith(STUDY_PREFIX))
    keys = [t.user_attrs["key"] for t in optuna.load_study(study_name=store, storage=url).trials]
    assert len(keys) == len(set(keys))  # two processes, and still nothing measured twice
    refine = optuna.load_study(
        study_name=next(n for n in studies if n.startswith("refine:")), storage=url
    )
    assert 6 <= len([t for t in refine.trials if t.state.is_finished()]) <= 7
    assert main(["status", "--storage", url]) == 0
    status = capsys.readouterr().out
    assert "done" in status and "/6" in status


def test_a_hopeless_native_plan_is_not_timed(tmp_path, monkeypatch):
    """Untuned TVM ran a BERT-768 in 5.9 s against the best plan's 27 ms; timing it took 83 s
    of the search. The native-only plan is left untimed (and says why) only when its measured
    regions add up to more than HOPELESS times the fastest plan timed; other plans always run."""
    from partune.frontend.models import load
    from partune.runners.timing import Measurement
    from partune.search.candidates import backend_plan
    from partune.search.dp import Cover
    from partune.search.session import HOPELESS, SearchSession, TuneOptions
    from tests.model_files import write_onnx

    model = load(str(write_onnx(tmp_path / "m.onnx")))
    session = SearchSession(model, ["tvm", "onnxruntime"], None, None, TuneOptions())
    plans = {
        f"{b}-only": backend_plan(model.name, model.mod, model.graph, session.config, b)
        for b in ("tvm", "onnxruntime")
    }
    bf16 = CompilationConfig.for_cpu(
        ["tvm", "onnxruntime"], bf16=("tvm",)
    )  # TVM's bf16: as hopeless
    plans["tvm-only (bf16)"] = backend_plan(model.name, model.mod, model.graph, bf16, "tvm", "bf16")
    session.result.end_to_end["partune dp"] = Measurement(1e-3, 0.0, 1e-3, 5, 1)
    for estimate_s, timed in [
        ((HOPELESS + 1) * 1e-3, ["onnxruntime-only"]),
        ((HOPELESS - 1) * 1e-3, ["tvm-only", "onnxruntime-only", "tvm-only (bf16)"]),
    ]:
        with monkeypatch.context() as patched:
            patched.setattr(session, "native_estimate", lambda native, e=estimate_s: e)
            assert sorted(session.worth_timing(plans)) == sorted(timed)
    skipped = session.result.end_to_end["tvm-only"]
    assert not skipped.ok and skipped.error.startswith(
        "not measured: its regions add up to 11.0 ms, 11x"
    )
    assert session.result.end_to_end["tvm-only (bf16)"] == skipped
    # The same bar for a refinement variant (its measured regions added up): 7 s against 0.32 s
    # was timed at 24 BERT layers.
    assert (
        session.hopeless((HOPELESS - 1) * 1e-3) is None
        and not session.hopeless((HOPELESS + 1) * 1e-3).ok
    )
    # The native-only estimate measures the regions it guessed (through the DP) only when the
    # guess is not hopeless already: a later --shapes bucket asked 23 untuned TVM kernels.
    asked = []
    monkeypatch.setattr(
        session, "dp", lambda *a, **k: asked.append(a) or (Cover((), 2e-3, 0), None)
    )
    nodes = len(model.graph)  # a region's guess by its nodes: every cover adds up to the same
    native = session.config.default
    for guess_s, measured in [((HOPELESS + 1) * 1e-3, False), ((HOPELESS - 1) * 1e-3, True)]:
        monkeypatch.setattr(session, "cost", lambda c, g=guess_s: g * len(c.subgraph.nodes) / nodes)
        estimate = session.native_estimate(native)
        assert bool(asked) == measured and estimate == (
            2e-3 if measured else pytest.approx(guess_s)
        )


def test_the_verdict_keeps_the_finalists_that_fit_in_free_memory():
    """Every contender of a verdict is built in one process: at 24 BERT-768 layers six took 13 GB
    and the out-of-memory killer ended it. Finalists are dropped, slowest first, until the
    estimate fits; the fastest always stays, and a device that does not say keeps them all."""
    from types import SimpleNamespace

    from partune.search.result import TuneResult
    from partune.search.verdict import (
        MEMORY_SHARE,
        MODEL_PER_WEIGHT,
        PEER_PER_WEIGHT,
        fit_in_memory,
    )

    gib = 2**30
    plans = {"slow": object(), "fast": object(), "middle": object()}
    cost = {"fast": 1.0, "middle": 2.0, "slow": 3.0}

    def session(free):
        result = TuneResult()
        result.end_to_end = {k: Measurement(c, 0, c, 1, 1, peak_bytes=gib) for k, c in cost.items()}
        return SimpleNamespace(
            runner=SimpleNamespace(available_bytes=lambda: free),
            result=result,
            graph=SimpleNamespace(nodes=[SimpleNamespace(const_bytes=gib // 4)]),
            model=SimpleNamespace(torch_module=None),  # an ONNX file: no torch peer
            config=SimpleNamespace(precisions=("f32",)),
            options=SimpleNamespace(peers=("onnxruntime", "openvino", "torch.compile")),
        )

    fixed = (MODEL_PER_WEIGHT + 2 * PEER_PER_WEIGHT) * gib / 4
    assert fit_in_memory(session(None), plans) == plans
    roomy = session((fixed + 3 * gib) / MEMORY_SHARE + 1)
    assert fit_in_memory(roomy, plans) == plans and not roomy.result.verdict.left_out
    tight = session((fixed + 2 * gib) / MEMORY_SHARE + 1)
    assert list(fit_in_memory(tight, plans)) == ["fast", "middle"]
    assert (
        tight.result.verdict.left_out.startswith("slow left out")
        and "GB was free" in tight.result.verdict.left_out
    )
    assert list(fit_in_memory(session(gib), plans)) == [
        "fast"
    ]  # the fastest stays, whatever the memory
