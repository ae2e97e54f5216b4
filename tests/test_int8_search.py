"""An int8 search end to end, as a user runs it: calibration kept in the store, the int8 peers
timed with their errors, the emitted plan within budget, a rerun measuring nothing."""

import json

import numpy as np

from partune.cli import main
from partune.core import Plan
from tests.model_files import write_onnx


def test_an_int8_search_keeps_its_budget_and_a_rerun_measures_nothing(tmp_path, capsys):
    model = write_onnx(tmp_path / "tiny.onnx")
    np.savez(
        tmp_path / "cal.npz",
        x=np.random.default_rng(1).standard_normal((6, 1, 3, 16, 16)).astype("float32"),
    )
    args = [
        "--input-shape",
        "x=1,3,16,16",
        "tune",
        str(model),
        "--backends",
        "tvm,onnxruntime",
        "--peers",
        "onnxruntime",
        "--precision",
        "int8",
        "--tolerance",
        "0.05",
        "--calibration",
        str(tmp_path / "cal.npz"),
        "--refine-trials",
        "2",
        "--storage",
        f"sqlite:///{tmp_path / 'm.db'}",
        "-o",
        str(tmp_path / "plan.json"),
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "4 samples to calibrate, 2 samples to validate" in first
    assert "(peer) onnxruntime int8" in first  # quantize_static on the file, timed
    plan = Plan.load(tmp_path / "plan.json")
    notes = json.loads((tmp_path / "plan.json").read_text())["notes"]
    if "int8" in plan.precisions:  # an int8 plan carries its ranges and keeps its budget
        assert plan.calibration is not None and plan.calibration.ranges
        assert notes["rel_error"] <= 0.05
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "measurements made 0" in again
    assert "calibrate int8 ranges" in first and "calibrate int8 ranges" not in again  # kept
    assert Plan.load(tmp_path / "plan.json").to_json()["regions"] == plan.to_json()["regions"]
