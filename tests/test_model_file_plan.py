"""When no partitioned plan beats a library on the user's own file, that file is the plan.

The plan is then never slower than the best library peer: it is emitted, runs with
``partune run``, exports and deploys, and it refuses any other file.
"""

from __future__ import annotations

import json

import pytest

from partune.cli import main
from tests.model_files import write_matmul_onnx

# One test process runs this module under ``make test`` (pytest-xdist): its module fixture tunes a
# model once.
pytestmark = pytest.mark.xdist_group("model_file_plan")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Over untuned TVM alone, two 384x384 matmuls lose to any BLAS by far."""
    folder = tmp_path_factory.mktemp("model_file")
    model = write_matmul_onnx(folder / "mm.onnx")
    plan = folder / "plan.json"
    args = [
        "tune",
        str(model),
        "--backends",
        "tvm",
        "--peers",
        "onnxruntime,openvino",
        "--storage",
        f"sqlite:///{folder / 'm.db'}",
        "-o",
        str(plan),
    ]
    assert main(args) == 0
    return folder, model, plan


def test_the_users_file_under_the_fastest_library_is_emitted(tuned, capsys):
    _, model, plan_path = tuned
    plan = json.loads(plan_path.read_text())
    notes = plan["notes"]
    assert plan["model_file"]["library"] in ("onnxruntime", "openvino")
    assert plan["model_file"]["origin"] == "your .onnx file"
    assert notes["chosen_as"] == notes["best_peer"]  # the fastest library peer is the plan
    medians = notes["verdict_median_s"]
    assert medians[notes["chosen_as"]] == min(medians.values())
    assert medians[notes["chosen_as"]] < notes["best_partitioned_median_s"]
    assert set(notes["peers"]) == {"onnxruntime (your .onnx file)", "openvino (your .onnx file)"}


def test_the_model_file_plan_runs_exports_and_deploys(tuned, capsys):
    folder, model, plan = tuned
    capsys.readouterr()
    assert main(["run", str(model), "--plan", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "the model's own ONNX graph (your .onnx file)" in out
    assert float(out.split("max |err|")[1].split()[0]) < 1e-4
    deploy = folder / "deploy"
    assert main(["export", str(model), "--plan", str(plan), "-o", str(deploy)]) == 0
    manifest = json.loads((deploy / "manifest.json").read_text())
    assert manifest["model_file"]["file"] == "model.onnx" and not (deploy / "model.so").exists()
    assert (deploy / "model.onnx").read_bytes() == model.read_bytes()
    capsys.readouterr()
    assert main(["run", str(deploy)]) == 0
    out = capsys.readouterr().out
    assert (
        "the model's own ONNX graph" in out and float(out.split("max |err|")[1].split()[0]) < 1e-4
    )


def test_a_model_file_plan_refuses_another_file(tuned, tmp_path, capsys):
    _, _, plan = tuned
    import onnx

    other = tmp_path / "mm.onnx"
    edited = onnx.load(str(write_matmul_onnx(other)))
    edited.doc_string = "edited"  # the same graph (the plan fits it), but another file
    onnx.save(edited, str(other))
    assert main(["run", str(other), "--plan", str(plan)]) == 2
    assert "another ONNX file" in capsys.readouterr().err
