import numpy as np
import pytest

from partune.models import load
from runners.builder import build_plan
from search.errors import ModelError
from search.plan import single_backend_plan
from search.scopes import CompilationConfig
from tests.model_files import write_onnx, write_pt2, write_tvmscript


def _tvm_error(model) -> float:
    plan = single_backend_plan(model.name, model.graph, CompilationConfig.for_cpu(["tvm"]), "tvm", set())
    out = build_plan(plan, model.mod, model.graph)(model.inputs)
    return max(float(np.abs(o - r).max()) for o, r in zip(out, model.reference, strict=True))


@pytest.mark.parametrize("writer,suffix,source", [
    (write_onnx, ".onnx", "onnxruntime"),
    (write_pt2, ".pt2", "torch eager (ExportedProgram)"),
    (write_tvmscript, ".py", "untuned TVM"),
])
def test_each_format_imports_with_a_reference(tmp_path, writer, suffix, source):
    model = load(str(writer(tmp_path / f"m{suffix}")))
    assert model.reference_source == source
    assert len(model.graph) >= 3
    assert all(np.isfinite(r).all() and r.size for r in model.reference)
    assert _tvm_error(model) < 1e-4


def test_onnx_symbolic_batch_is_made_static(tmp_path):
    model = load(str(write_onnx(tmp_path / "m.onnx")))
    assert model.inputs[0].shape == (1, 3, 16, 16)


@pytest.mark.parametrize("content,match", [
    (b"\x00\x01garbage", "cannot read ONNX model"),
    (b"", "cannot read ONNX model"),
])
def test_corrupt_onnx(tmp_path, content, match):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(ModelError, match=match):
        load(str(bad))


def test_corrupt_pt2_and_tvmscript(tmp_path):
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="cannot read ExportedProgram"):
        load(str(tmp_path / "bad.pt2"))
    (tmp_path / "bad.py").write_text("this is ( not tvmscript")
    with pytest.raises(ModelError, match="cannot parse TVMScript"):
        load(str(tmp_path / "bad.py"))


def test_unknown_and_missing_models(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'resnet9000'"):
        load("resnet9000")
    with pytest.raises(ModelError, match="does not exist"):
        load(str(tmp_path / "nope.onnx"))


def test_zoo_gpt2_builds_despite_bool_cumsum():
    from tests.conftest import load_model

    gpt2 = load_model("gpt2-small")
    assert _tvm_error(gpt2) < 1e-3
