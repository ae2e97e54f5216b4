"""An int8 or bf16 peer within the budget that beats every partitioned plan is the plan.

Its plan keeps the recipe of the quantized file (tool and version, metric, budget, a digest of
the samples), and the export quantizes the model's file again into exactly the file the verdict
timed; other samples or another tool version are refused, never approximated.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from partune.cli import main
from partune.core import ModelFile, Plan, PlanError, model_file_plan
from partune.deployed import load as load_deployed
from partune.export import export
from partune.frontend import load
from partune.runners import Measurement, quantize_file
from partune.search import TuneOptions, model_file_data
from partune.search.int8_calibration import quantization_data
from partune.search.model_file_recipe import quantized_model_file
from partune.search.result import Verdict
from partune.search.verdict import fastest_library_peer
from tests.model_files import write_onnx

KIND = "openvino int8"
INT8 = TuneOptions(precision="int8", tolerance=0.5)


def _timed(median_s: float, rel_error: float | None = None) -> Measurement:
    return Measurement(median_s, 0.0, median_s, 7, 1, rel_error=rel_error)


def test_the_fastest_library_peer_within_budget_makes_the_plan():
    f32, int8, over = "openvino (f.onnx)", "openvino int8 (f.onnx)", "onnxruntime int8 (f.onnx)"
    torch = "torch.compile (inductor)"
    verdict = Verdict(
        {
            f32: _timed(2e-3),
            int8: _timed(1e-3, rel_error=5e-3),
            over: _timed(0.5e-3, rel_error=5e-2),  # fastest, but over the budget: no plan
            torch: _timed(0.1e-3),  # fastest of all, but runs no ONNX file
        },
        (f32, int8, over, torch),
        tolerance=1e-2,
    )
    assert fastest_library_peer(verdict) == int8
    assert fastest_library_peer(Verdict(verdict.measurements, verdict.peers, 1, 1e-3)) == f32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized")
    path = write_onnx(folder / "tiny.onnx")
    model = load(str(path))
    file = quantized_model_file("openvino", "your .onnx file", model.onnx_sha256, KIND, model, INT8)
    plan = model_file_plan(model.name, model.graph, _config(), file, {"kind": "model file"})
    return folder, path, model, plan


def _config():
    from partune.core import CompilationConfig

    return CompilationConfig.for_cpu(["tvm", "openvino"], 1, int8=("openvino",))


def test_a_quantized_plan_keeps_its_recipe_through_json(tiny):
    _, _, _, plan = tiny
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.model_file == plan.model_file
    assert again.model_file.quantizer == KIND and again.model_file.quantized_with.startswith("nncf")
    assert again.precisions == ("int8",)
    assert "quantized as the openvino int8 peer does it" in again.model_file.describe()
    f32 = ModelFile("openvino", "your .onnx file", "ab")
    assert f32.to_json() == {"library": "openvino", "origin": "your .onnx file", "sha256": "ab"}


def test_the_export_ships_the_file_the_peer_timed(tiny, tmp_path):
    _, path, model, plan = tiny
    timed = quantize_file(KIND, path.read_bytes(), quantization_data(model, INT8))
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load_from_string(timed).graph.node)
    out = export(model, plan, tmp_path / "deploy")
    assert (out / "model.onnx").read_bytes() == timed
    run = load_deployed(out)
    got, want = run(*model.inputs), model.reference[0]
    assert np.linalg.norm(got[0] - want) / np.linalg.norm(want) < INT8.tolerance


def test_other_samples_or_another_tool_version_are_refused(tiny, tmp_path, capsys):
    folder, path, model, plan = tiny
    np.savez(tmp_path / "mine.npz", x=np.ones((4, 1, 3, 16, 16), "float32"))
    plan_file = folder / "plan.json"
    plan.save(plan_file)
    args = ["export", str(path), "--plan", str(plan_file), "-o", str(tmp_path / "d")]
    assert main([*args, "--calibration", str(tmp_path / "mine.npz")]) == 2
    assert "quantized on other samples" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    from dataclasses import replace

    older = replace(plan.model_file, quantized_with="nncf 0.0.1")
    with pytest.raises(PlanError, match="quantized by nncf 0.0.1"):
        model_file_data(model, older)
