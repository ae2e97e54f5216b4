"""Export a plan to a deploy directory; load and run it in a fresh process with no search code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from partune.cli import main
from partune.core.plan import Plan, Region
from partune.core.scopes import CompilationConfig
from partune.export import export
from tests.conftest import load_model

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["tvm", "torch", "onnxruntime", "openvino"]
CONFIG = CompilationConfig.for_cpu(ORDER)
# One test process runs this module under ``make test`` (pytest-xdist): its module fixture tunes a
# model once.
pytestmark = pytest.mark.xdist_group("deploy")

_LOAD = """
import sys, numpy as np
import partune.deployed as d
model = d.load(sys.argv[1])
with np.load(sys.argv[1] + "/example_inputs.npz") as z:
    inputs = [z[f"arr_{i}"] for i in range(len(z.files))]
with np.load(sys.argv[1] + "/reference_outputs.npz") as z:
    ref = [z[f"arr_{i}"] for i in range(len(z.files))]
out = model(*inputs)
"""
FRESH = (
    _LOAD
    + """
err = max(float(np.abs(o - r).max()) for o, r in zip(out, ref))
above = (["partune", "search"], ["partune", "store"], ["partune", "cost_models"])
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in above)
print(err, loaded)
"""
)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """bert-small with regions rotating over all four backends, exported."""
    model = load_model("bert-small")
    n = len(model.graph)
    regions = tuple(
        Region(tuple(range(s, min(s + 9, n))), CONFIG.scope_for(ORDER[i % 4]))
        for i, s in enumerate(range(0, n, 9))
    )
    plan = Plan(model.name, model.graph.fingerprint, CONFIG, regions)
    return export(model, plan, tmp_path_factory.mktemp("deploy") / "bert")


def test_runs_in_a_fresh_process_without_search_code(deployed):
    manifest = json.loads((deployed / "manifest.json").read_text())
    assert set(manifest["backends"]) == {"torch", "onnxruntime", "openvino"}  # tvm is compiled in
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(deployed)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    err, loaded = done.stdout.strip().split(" ", 1)
    assert float(err) < 1e-3
    assert loaded == "[]", f"the deploy path imported {loaded}"


def test_partune_run_on_the_directory(deployed, capsys):
    assert main(["run", str(deployed)]) == 0
    out = capsys.readouterr().out
    assert "deployed   bert-small" in out and "max |err|" in out
    err = float(out.split("max |err|")[1].split()[0])
    assert err < 1e-3


def test_a_modified_file_is_refused(deployed, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(deployed, copy)
    region = next((copy / "regions").iterdir())
    region.write_text(region.read_text().replace('"float32"', '"float16"', 1))
    assert main(["run", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "was modified" in err and len(err.strip().splitlines()) == 1


def test_another_environment_is_refused(deployed, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(deployed, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["environment"]["apache-tvm"] = "0.19.0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(copy)]) == 2
    assert "exported for another environment" in capsys.readouterr().err


def test_wrong_input_shape_is_a_clear_error(deployed, tmp_path, capsys):
    bad = tmp_path / "x.npy"
    np.save(bad, np.zeros((3, 3), "float32"))
    args = ["run", str(deployed)] + [
        a
        for _ in json.loads((deployed / "manifest.json").read_text())["inputs"]
        for a in ("--input", str(bad))
    ]
    assert main(args) == 2
    assert "must be" in capsys.readouterr().err


def test_status_report_and_export_of_a_study(tmp_path, capsys):
    from tests.model_files import write_onnx

    model = write_onnx(tmp_path / "tiny.onnx")
    url = f"sqlite:///{tmp_path / 'm.db'}"
    assert (
        main(
            [
                "tune",
                str(model),
                "--backends",
                "tvm,onnxruntime",
                "--peers",
                "none",
                "--storage",
                url,
                "--study",
                "tiny-job",
                "-o",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    assert (
        tmp_path / "m.costmodel.json"
    ).is_file()  # the cost model is on by default, kept beside the store
    assert (
        main(["report", "--study", "tiny-job", "--storage", url, "-o", str(tmp_path / "report")])
        == 0
    )
    report = (tmp_path / "report" / "report.md").read_text()
    chosen = json.loads((tmp_path / "plan.json").read_text())["notes"]["chosen_as"]
    assert f"Emitted plan: **{chosen}**" in report
    pngs = {p.name: p for p in (tmp_path / "report").glob("*.png")}
    assert set(pngs) == {"history.png", "shares.png", "graph.png", "regions.png"}
    from matplotlib.image import imread

    for name, path in pngs.items():  # real pictures, not empty canvases
        pixels = imread(path)
        assert min(pixels.shape[:2]) > 100 and np.ptp(pixels[..., :3]) > 0.1, name
    capsys.readouterr()
    assert main(["status", "--storage", url]) == 0
    status = capsys.readouterr().out
    assert "tiny-job" in status
    assert re.search(r"\| search \d+\.\d GB, measuring workers \d+\.\d GB", status), (
        status
    )  # its peaks
    assert (
        main(["export", "--study", "tiny-job", "--storage", url, "-o", str(tmp_path / "dep")]) == 0
    )
    capsys.readouterr()
    assert main(["run", str(tmp_path / "dep")]) == 0
    assert "max |err|" in capsys.readouterr().out
    assert main(["export", "--study", "nope", "--storage", url, "-o", str(tmp_path / "d2")]) == 2


def test_an_export_killed_half_way_leaves_the_last_deployment_whole(tmp_path):
    """SIGKILL in the middle of `partune export`: the previous directory still loads, and the
    next export clears what the killed one left and replaces it."""
    import os
    import signal
    import time

    from partune.deployed import load
    from partune.frontend.models import load_onnx
    from tests.model_files import write_onnx

    model_file = write_onnx(tmp_path / "tiny.onnx")
    out = tmp_path / "dep"
    plan = tmp_path / "plan.json"
    graph = load_onnx(model_file).graph
    Plan(
        "tiny",
        graph.fingerprint,
        CONFIG,
        (Region(tuple(range(len(graph))), CONFIG.scope_for("tvm")),),
    ).save(plan)
    cmd = [
        sys.executable,
        "-m",
        "partune.cli",
        "export",
        str(model_file),
        "--plan",
        str(plan),
        "-o",
        str(out),
    ]
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True).returncode == 0
    before = (out / "manifest.json").read_text()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".dep.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".dep.partial-*")), "the export never started staging"
    assert (out / "manifest.json").read_text() == before
    load(out)  # the last deployment is whole
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True).returncode == 0
    assert not list(tmp_path.glob(".dep.*")) and load(out) is not None


FRESH_REL = (
    _LOAD + "print(max(np.linalg.norm(o - r) / np.linalg.norm(r) for o, r in zip(out, ref)))\n"
)


def test_an_int8_plan_deploys_with_its_calibrated_ranges(tmp_path):
    """The plan's ranges travel in its JSON: the exported model computes its int8 region with
    them, in a fresh process, close to f32 and not equal to it."""
    from partune.backends import registry
    from partune.core import Calibration, single_backend_plan
    from partune.runners.capture import capture_values
    from partune.search.candidates import accepted_nodes
    from partune.search.int8_calibration import calibrated_tensors, ranges_over

    model = load_model("bert-small")
    config = CompilationConfig.for_cpu(ORDER, int8=registry.int8_names(ORDER))
    tensors = calibrated_tensors(model.mod["main"])
    values = capture_values(model.mod, model.graph, model.inputs, ["onnxruntime"])
    calibration = Calibration("test", ranges_over([values], tensors))
    accepted = accepted_nodes(model.mod["main"], "onnxruntime")
    plan = single_backend_plan(
        model.name, model.graph, config, "onnxruntime", accepted, precision="int8"
    )
    plan = Plan(plan.model, plan.fingerprint, config, plan.regions, calibration=calibration)
    out = export(model, plan, tmp_path / "int8")
    assert Plan.load(out / "plan.json").calibration.ranges == calibration.ranges
    done = subprocess.run(
        [sys.executable, "-c", FRESH_REL, str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert 1e-6 < float(done.stdout.strip()) < 0.1
