"""`partune explain`: every region of a plan, its candidates, margins and losers' reasons, read
from the store and never measured; and the terminal's op names and fitted columns (issue 17)."""

from __future__ import annotations

import json
import time

import optuna
import pytest

from partune.cli import main
from partune.core.describe import fit_table, op_summary, region_label
from partune.core.graph import DataflowGraph, Node, OpKind
from partune.core.keys import candidate_key
from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig
from partune.cost_models.borders import BorderModel
from partune.explain import (
    CHOSEN,
    FAILED,
    MEASURED,
    REFUSED,
    UNPROPOSED,
    explain,
    render_text,
    to_json,
)
from partune.explain_evidence import Evidence
from partune.runners.timing import Measurement
from partune.store.measurements import STUDY_PREFIX
from tests.graphs import Residual
from tests.model_files import write_onnx, write_tvmscript

# One test process runs this module under ``make test`` (pytest-xdist): its module fixture tunes a
# model once.
pytestmark = pytest.mark.xdist_group("explain")

BACKENDS = ["tvm", "onnxruntime"]
STUDY = "tiny-explain"


def _fails_cleanly(capsys, argv, match):
    assert main(argv) == 2
    err = [
        ln
        for ln in capsys.readouterr().err.strip().splitlines()
        if not ln.startswith("partune: note:")
    ]
    assert len(err) == 1, err
    assert err[0].startswith("partune: error:") and match in err[0], err


def _graph(ops: list[str]) -> DataflowGraph:
    """A chain of ``ops`` (only the ops matter to the summaries)."""
    nodes = tuple(
        Node(i, f"v{i}", op, OpKind.OPAQUE, (i - 1,) if i else (), ((1,),), ("float32",), 0, 0, "")
        for i, op in enumerate(ops)
    )
    return DataflowGraph(nodes, (len(ops) - 1,), ("x",))


def _m(best_s: float, median_s: float | None = None) -> Measurement:
    return Measurement(median_s or best_s * 1.2, best_s * 0.1, best_s, 5, 10, best_s=best_s)


# -- the terminal: op names, fitted columns -------------------------------------------------


def test_regions_are_named_by_their_ops():
    g = _graph(["nn.conv2d", "nn.relu"] * 3 + ["matmul", "matmul", "add", "nn.gelu"])
    assert region_label(g, range(6)) == "conv2d+relu x3"
    assert region_label(g, [6, 7, 8, 9]) == "matmul x2+add+gelu"
    assert region_label(g, [6]) == "matmul"
    assert op_summary(g, [6, 7, 8, 9]) == "matmul x2, add, gelu"
    assert op_summary(g, range(10), limit=2) == "conv2d x3, relu x3, +3 more kinds"
    assert len(region_label(g, range(10), width=12)) == 12


def test_tables_fit_their_content():
    rows = [["a" * 45, "running, 9m55s left", "3/8"], ["b", "done", "-"]]
    lines = fit_table(("study", "state", "refined"), rows, "<<>", pipes=True)
    assert "a" * 45 in lines[2] and "running, 9m55s left" in lines[2]
    assert len({len(ln) for ln in lines}) == 1
    plain = fit_table(("x", "y"), [["1", "long cell"]])
    assert plain[2] == "1  long cell"


def test_status_cuts_nothing(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 's.db'}"
    name = "a-model-with-a-rather-long-name.onnx:tvm,torch,onnxruntime,openvino"
    study = optuna.create_study(study_name=name, storage=url)
    study.set_user_attr("started", time.time())
    study.set_user_attr("deadline", time.time() + 595)
    study.set_user_attr("n_trials", 8)
    assert main(["status", "--storage", url]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [ln for ln in out if ln.startswith("|")]
    assert name in table[2] and "s left" in table[2] and "running, 9m5" in table[2]
    assert len({len(ln) for ln in table}) == 1
    # A running job's phase and its processes' peak memory so far (written by the job as it goes).
    study.set_user_attr("running", {"phase": "measure candidates", "at": time.time()})
    study.set_user_attr(
        "memory", {"search": 2_100_000_000, "measuring": 900_000_000, "measuring_recycled": 2}
    )
    assert main(["status", "--storage", url]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")][2]
    assert "left: measure candidates" in row
    assert "search 2.1 GB, measuring workers 0.9 GB (recycled 2 times)" in row


# -- explain's logic on hand-made evidence -----------------------------------------------------


def test_explain_says_why_each_backend_lost():
    graph = DataflowGraph.from_function(Residual["main"])  # conv2d, relu, add, sum
    config = CompilationConfig.for_cpu(["tvm", "torch", "onnxruntime"])
    tvm, torch, ort = (config.scope_for(b) for b in ("tvm", "torch", "onnxruntime"))
    key = lambda nodes, scope: candidate_key(graph, nodes, scope)  # noqa: E731
    measured = {
        key((0, 1), torch): _m(10e-6),
        key((0, 1), tvm): _m(30e-6),
        key((0, 1), ort): Measurement.failed("build: scope onnxruntime@cpu:*/*/* has no target"),
        key((2, 3), tvm): _m(5e-6),
    }
    ev = Evidence(
        measured,
        {
            "tvm": frozenset(range(4)),
            "torch": frozenset({0, 1, 2}),
            "onnxruntime": frozenset({0, 1, 3}),
        },
        {
            "tvm": frozenset({(0, 1), (2, 3)}),
            "torch": frozenset({(0, 1)}),
            "onnxruntime": frozenset({(0, 1)}),
        },
        {"tvm": -2e-6, "torch": 1e-6},
        {"tvm": "tvm", "torch": "arbitrary", "onnxruntime": "arbitrary"},
        device="dev",
    )
    notes = {
        "chosen_as": "partune dp",
        "measured_s": 20e-6,
        "border_model": BorderModel((1e-6, 1e-9, 0.0), 4).describe(),
        "verdict_median_s": {"partune dp": 20e-6, "onnxruntime (model)": 30e-6},
        "peers": ["onnxruntime (model)"],
        "best_peer": "onnxruntime (model)",
        "speedup_vs_best_peer": 1.5,
        "peers_unavailable": {
            "torch.compile (inductor)": "RuntimeError: scope tvm@cpu:*/*/* has no target"
        },
    }
    plan = Plan(
        "residual",
        graph.fingerprint,
        config,
        (Region((0, 1), torch, 10e-6), Region((2, 3), tvm, 5e-6)),
        notes=notes,
    )
    e = explain(plan, graph, ev, "a test")
    first, second = e.regions
    assert first.ops == "conv2d, relu" and first.nodes == (0, 1) and first.backend == "torch"
    rows = {c.backend: c for c in first.candidates}
    assert first.candidates[0].backend == "torch" and rows["torch"].status == CHOSEN
    assert rows["torch"].in_model_s == pytest.approx(11e-6) and rows[
        "tvm"
    ].in_model_s == pytest.approx(28e-6)
    assert first.runner_up == "tvm" and first.margin_s == pytest.approx(17e-6)
    assert rows["tvm"].status == MEASURED and rows["tvm"].reason.startswith("slower by 17.0 us")
    assert rows["onnxruntime"].status == FAILED and "@" not in rows["onnxruntime"].reason
    assert rows["onnxruntime"].reason == "failed: build: scope onnxruntime has no target"
    assert second.runner_up is None and second.margin_s is None
    assert second.note == (
        "only tvm takes these nodes: torch does not accept sum (node 3); "
        "onnxruntime does not accept add (node 2)"
    )
    assert {c.status for c in second.candidates[1:]} == {REFUSED}
    assert first.border_s > 1e-6 and e.border_total_s == pytest.approx(
        first.border_s + second.border_s
    )
    peers = {p.label: p for p in e.peers}
    assert peers["onnxruntime (model)"].plan_speedup == pytest.approx(1.5)
    assert "@" not in peers["torch.compile (inductor)"].error
    text = render_text(e)
    assert "region 1/2: torch, nodes 0-1 (2): conv2d, relu" in text and "region 2/2: tvm" in text
    assert "@cpu" not in text
    json.dumps(to_json(e), allow_nan=False)
    # A backend that accepts every op of a region its rule never proposed says so.
    ev2 = Evidence(
        {}, ev.accepted, {"tvm": frozenset(), "torch": frozenset(), "onnxruntime": frozenset()}
    )
    lone = explain(plan, graph, ev2, "a test").regions[0]
    assert {c.backend: c.status for c in lone.candidates}["onnxruntime"] == UNPROPOSED


# -- explain on a real tuning job -------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny ONNX model tuned over tvm and onnxruntime: (model file, storage URL, plan)."""
    tmp = tmp_path_factory.mktemp("explain")
    model = write_onnx(tmp / "tiny.onnx")
    url, out = f"sqlite:///{tmp / 'm.db'}", tmp / "plan.json"
    assert (
        main(
            [
                "tune",
                str(model),
                "--backends",
                ",".join(BACKENDS),
                "--peers",
                "none",
                "--n-trials",
                "2",
                "--study",
                STUDY,
                "--storage",
                url,
                "-o",
                str(out),
            ]
        )
        == 0
    )
    return model, url, Plan.load(out)


def _stored(url: str) -> dict[str, Measurement]:
    name = next(
        s.study_name
        for s in optuna.get_all_study_summaries(url)
        if s.study_name.startswith(STUDY_PREFIX)
    )
    return {
        t.user_attrs["key"]: Measurement(**t.user_attrs["m"])
        for t in optuna.load_study(study_name=name, storage=url).trials
    }


def test_explain_a_study_lists_every_region(tuned, capsys):
    from partune.frontend.models import load

    model, url, plan = tuned
    capsys.readouterr()
    assert main(["explain", "--study", STUDY, "--storage", url]) == 0
    text = capsys.readouterr().out
    graph = load(str(model)).graph
    n = len(plan.regions)
    for i, r in enumerate(plan.regions, 1):
        assert f"region {i}/{n}: {r.backend}," in text and op_summary(graph, r.nodes) in text
    assert main(["explain", "--study", STUDY, "--storage", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [tuple(r["nodes"]) for r in data["regions"]] == [
        tuple(sorted(r.nodes)) for r in plan.regions
    ]
    assert [r["backend"] for r in data["regions"]] == [r.backend for r in plan.regions]
    for r in data["regions"]:
        assert sorted(c["backend"] for c in r["candidates"]) == sorted(BACKENDS)
        assert r["candidates"][0]["status"] == CHOSEN


def test_explain_a_plan_file_margins_match_the_store(tuned, tmp_path, capsys):
    """Single-node regions (every one a measured candidate of both backends): the times shown
    are the store's, the runner-up is the other backend, and the margin is their difference."""
    from partune.frontend.models import load

    model, url, tuned_plan = tuned
    graph = load(str(model)).graph
    config = tuned_plan.config
    regions = tuple(Region((i,), config.scope_for(BACKENDS[i % 2])) for i in range(len(graph)))
    path = tmp_path / "singles.json"
    Plan("tiny", graph.fingerprint, config, regions, notes={"kind": "hand-made"}).save(path)
    before = _stored(url)
    assert main(["explain", str(model), "--plan", str(path), "--storage", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert _stored(url).keys() == before.keys()  # explain measured nothing
    assert len(data["regions"]) == len(graph)
    for r, region in zip(data["regions"], regions, strict=True):
        win, lose = r["candidates"]
        stored = before[candidate_key(graph, region.nodes, region.scope)]
        assert win["backend"] == region.backend and win["best_s"] == pytest.approx(stored.cost_s)
        assert win["median_s"] == pytest.approx(stored.median_s) and win["source"] == "measured"
        if lose["status"] == MEASURED:
            assert r["runner_up"] == lose["backend"]
            assert r["margin_s"] == pytest.approx(lose["in_model_s"] - win["in_model_s"])
            word = "slower by" if r["margin_s"] >= 0 else "faster alone by"
            assert lose["reason"].startswith(word)
    assert any(r["runner_up"] for r in data["regions"])


def test_bad_input_is_one_line(tuned, tmp_path, capsys):
    model, url, plan = tuned
    _fails_cleanly(
        capsys,
        ["explain", "--study", "no-such-study", "--storage", url],
        "no study 'no-such-study'",
    )
    _fails_cleanly(
        capsys,
        ["explain", "--study", STUDY, "--storage", f"sqlite:///{tmp_path / 'none.db'}"],
        "no storage at",
    )
    assert not (tmp_path / "none.db").exists()  # reading created nothing
    _fails_cleanly(capsys, ["explain", "--study", STUDY, "--storage", "memory"], "keeps nothing")
    _fails_cleanly(capsys, ["explain", "--storage", url], "needs --study NAME")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _fails_cleanly(
        capsys, ["explain", str(model), "--plan", str(bad), "--storage", url], "is not JSON"
    )
    good = tmp_path / "plan.json"
    plan.save(good)
    _fails_cleanly(capsys, ["explain", "--plan", str(good), "--storage", url], "name its file")
    other = write_tvmscript(tmp_path / "other.py")
    _fails_cleanly(
        capsys, ["explain", str(other), "--plan", str(good), "--storage", url], "another model"
    )
