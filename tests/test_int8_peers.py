"""The int8 peers: the user's own quantizers on the user's file. NNCF's accuracy control is held
to the same samples, metric and budget as Partune's plans, and gives back accuracy only by
keeping layers in f32."""

import numpy as np
import onnx
import pytest

from partune.backends import open_model_file
from partune.runners.accuracy import metric_error
from partune.runners.int8_peers import (
    ACCURACY_CONTROL,
    INT8_PEERS,
    QuantizationData,
    nncf_accuracy_control,
    nncf_int8,
)
from tests.model_files import write_onnx


def _data(tolerance: float) -> QuantizationData:
    rng = np.random.default_rng(3)
    draw = [[rng.standard_normal((1, 3, 16, 16)).astype("float32")] for _ in range(6)]
    return QuantizationData(draw[:4], draw[4:], "rel", tolerance)


def _error(quantized: bytes, f32: bytes, q: QuantizationData) -> float:
    run = open_model_file("openvino", quantized, q.validation[0], 1)
    reference = open_model_file("openvino", f32, q.validation[0], 1)
    return metric_error(
        q.metric, [run(s) for s in q.validation], [reference(s) for s in q.validation]
    )


def _quantizers(data: bytes) -> int:
    return sum(n.op_type == "QuantizeLinear" for n in onnx.load_from_string(data).graph.node)


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> bytes:
    return write_onnx(tmp_path_factory.mktemp("peers") / "tiny.onnx").read_bytes()


def test_accuracy_control_reverts_layers_until_the_budget_holds(f32):
    loose, tight = _data(0.5), _data(1e-5)
    whole = nncf_int8(f32, loose)
    assert _error(whole, f32, tight) > tight.tolerance  # plain int8 misses the tight budget
    kept = nncf_accuracy_control(f32, tight)
    assert _error(kept, f32, tight) <= tight.tolerance
    assert _quantizers(kept) < _quantizers(whole)  # by reverting layers to f32
    assert _quantizers(nncf_accuracy_control(f32, loose)) == _quantizers(whole)  # nothing to give


def test_the_reduced_peers_come_with_their_library_unless_some_are_named():
    from partune.runners import peers_at

    libraries = ("onnxruntime", "openvino")
    assert peers_at(libraries, ("f32",)) == libraries
    assert set(peers_at(libraries, ("f32", "int8"))) == {*libraries, *INT8_PEERS}
    assert set(peers_at(("openvino",), ("f32", "bf16", "int8"))) == {
        "openvino",
        "openvino bf16",
        "openvino int8",
        ACCURACY_CONTROL,
    }
    named = (*libraries, "onnxruntime int8", "openvino int8")  # accuracy control left out
    assert peers_at(named, ("f32", "int8")) == named
    assert set(peers_at(named, ("f32", "bf16", "int8"))) == {*named, "openvino bf16"}
