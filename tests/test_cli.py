"""Bad input: one line on stderr, exit code 2, no traceback."""

import json

import pytest

from partune.cli import main
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig
from tests.model_files import write_onnx, write_tvmscript


def _fails_cleanly(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("partune: error:") and match in err, err


@pytest.fixture
def plan_file(tmp_path, bert):
    def write(mutate=lambda d: d):
        data = single_backend_plan(
            bert.name, bert.graph, CompilationConfig.for_cpu(["tvm"]), "tvm", set()
        ).to_json()
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(mutate(data)))
        return str(path)

    return write


def test_unknown_model(capsys):
    _fails_cleanly(capsys, ["run", "no-such-model"], "unknown model 'no-such-model'")


def test_corrupt_model_file(capsys, tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    _fails_cleanly(capsys, ["run", str(bad)], "cannot read ONNX model")


def test_unknown_backend(capsys):
    _fails_cleanly(
        capsys, ["run", "bert-small", "--backend", "tensorrt"], "unknown backend 'tensorrt'"
    )


def test_plan_for_another_model(capsys, plan_file, tmp_path):
    script = write_tvmscript(tmp_path / "other.py")
    _fails_cleanly(capsys, ["run", str(script), "--plan", plan_file()], "another model")


def test_plan_with_unknown_backend(capsys, plan_file):
    def mutate(d):
        d["regions"][0]["scope"]["backend"] = "cudnn"
        return d

    _fails_cleanly(
        capsys, ["run", "bert-small", "--plan", plan_file(mutate)], "unknown backend 'cudnn'"
    )


def test_plan_leaving_nodes_uncovered(capsys, plan_file):
    def mutate(d):
        d["regions"][0]["nodes"] = d["regions"][0]["nodes"][:-3]
        return d

    _fails_cleanly(capsys, ["run", "bert-small", "--plan", plan_file(mutate)], "uncovered")


def test_overlapping_plan(capsys, plan_file):
    def mutate(d):
        d["regions"].append({"nodes": [0, 1], "scope": d["regions"][0]["scope"]})
        return d

    _fails_cleanly(capsys, ["run", "bert-small", "--plan", plan_file(mutate)], "in two regions")


def test_run_prints_latency_and_error(capsys, tmp_path):
    saved = tmp_path / "p.json"
    assert main(["run", str(write_tvmscript(tmp_path / "m.py")), "--save-plan", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "latency" in out and "max |err|" in out
    assert json.loads(saved.read_text())["regions"]


def test_bench_prints_a_ratio_table(capsys, tmp_path):
    onnx_file = write_onnx(tmp_path / "m.onnx")
    assert main(["bench", str(onnx_file), "--peers", "onnxruntime,openvino"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "contender" not in ln]
    names = {ln.split("|")[1].strip() for ln in rows}
    assert names == {
        "partune tvm-only plan",
        "partune torch-only plan",
        "partune onnxruntime-only plan",
        "partune openvino-only plan",
        "onnxruntime (your .onnx file)",
        "openvino (your .onnx file)",
    }
    ratios = [float(ln.split("|")[-2]) for ln in rows]
    assert min(ratios) == 1.0 and all(r >= 1.0 for r in ratios)


def test_tvm_database_is_handed_to_the_tvm_backend(capsys, tmp_path, backend_settings):
    db = tmp_path / "ms"
    db.mkdir()
    from partune.backends import registry

    assert main(["--tvm-database", str(db), "run", str(write_tvmscript(tmp_path / "m.py"))]) == 0
    assert registry.settings().tvm_database == str(db) and registry.get("tvm").database_dir == str(
        db
    )
    assert (db / "database_workload.json").exists()  # MetaSchedule opened it while building
    _fails_cleanly(
        capsys, ["--tvm-database", str(tmp_path / "nope"), "run", "bert-small"], "not a directory"
    )


def test_an_unknown_import_pass_is_refused_before_anything_runs(capsys):
    _fails_cleanly(
        capsys,
        ["--disable-pass", "NoSuchPass", "run", "bert-small"],
        "no import pass named NoSuchPass",
    )


def test_list_passes_names_every_pass_in_order(capsys):
    from partune.frontend.pipeline import NAMES

    with pytest.raises(SystemExit) as done:
        main(["--list-passes"])
    assert done.value.code == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == list(NAMES)


def _max_err(out: str) -> float:
    return float(next(line for line in out.splitlines() if line.startswith("max |err|")).split()[2])


def test_run_v_prints_what_each_pass_did_and_every_pass_can_be_off(capsys, tmp_path):
    """With every import pass left out, the module as imported still runs under a plan and
    matches the reference (the passes are rewrites, not requirements)."""
    from partune.frontend.pipeline import NAMES

    model = str(write_onnx(tmp_path / "m.onnx"))
    assert main(["run", model, "--backend", "onnxruntime", "-v"]) == 0
    out = capsys.readouterr().out
    assert all(f"pass {n}" in out for n in NAMES) and "rewritten" in out and _max_err(out) < 1e-4
    off = [a for n in NAMES for a in ("--disable-pass", n)]
    assert main([*off, "run", model, "--backend", "onnxruntime", "-v"]) == 0
    out = capsys.readouterr().out
    assert out.count("disabled") == len(NAMES) and _max_err(out) < 1e-4
