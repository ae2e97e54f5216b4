"""The user's own int8 tools on the user's own file: what an int8 plan must beat.

A user who wants int8 without Partune quantizes the whole model with the library's own tool,
on the same calibration data, and runs it in that library:

- onnxruntime's ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations, its
  default MinMax calibration), run by onnxruntime;
- NNCF's ``quantize`` (OpenVINO's post-training quantization, on the ONNX file), run by
  OpenVINO;
- NNCF's ``quantize_with_accuracy_control``, run by OpenVINO: ``quantize``, then the layers
  whose int8 costs the most accuracy go back to f32, one group at a time, until the error on
  the validation samples is within the budget (it reverts by sensitivity, not by speed). It is
  judged on the same samples, metric and budget as Partune's plans.

The first two quantize every op they can, so their error is whatever it comes to. On a CPU
without VNNI each is given the setting its own guide prescribes against int16 saturation
(onnxruntime's ``reduce_range``, NNCF's ``OverflowFix.ENABLE``: 7-bit weights; Partune's
regions take the bit from the activations instead, ``partune.core.int8``), so the peer is the
strongest a user of that tool would run. A peer over the accuracy budget is timed and reported
with its error, but is no bar to beat. The quantized files are made in the search process
(calibration runs the model, untimed) and timed like the f32 peers (``partune.runners.peers``).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

ACCURACY_CONTROL = "openvino int8 accuracy-control"
INT8_PEERS = ("onnxruntime int8", "openvino int8", ACCURACY_CONTROL)


@dataclass(frozen=True)
class QuantizationData:
    """What the int8 peers are quantized on (``calibration``) and, where a tool controls its
    accuracy, held to: ``metric`` (``partune.runners.accuracy.METRICS``) within ``tolerance``
    on ``validation``, the samples the plans are judged on. Each sample is the model's inputs
    in order."""

    calibration: list[list[np.ndarray]]
    validation: list[list[np.ndarray]]
    metric: str = "rel"
    tolerance: float = 1e-2

    @property
    def digest(self) -> str:
        """A name for the samples, metric and budget: a quantized file is a function of them
        (and of the tool), so a plan that ships one names them (``partune.core.ModelFile``)."""
        h = hashlib.sha256(f"{self.metric}:{self.tolerance!r}".encode())
        for part, samples in (("c", self.calibration), ("v", self.validation)):
            for sample in samples:
                h.update(part.encode())
                for a in sample:
                    a = np.ascontiguousarray(a)
                    h.update(f"{a.dtype}{a.shape}".encode())
                    h.update(a.tobytes())
        return h.hexdigest()[:16]


def _without_vnni() -> bool:
    """Whether int8 products here risk int16 saturation (``partune.core.int8``: no VNNI)."""
    from partune.core import INT8_ACTIVATION_LEVELS

    return INT8_ACTIVATION_LEVELS < 255


def _feeds(model: onnx.ModelProto, samples: Sequence[Sequence[np.ndarray]]) -> list[dict]:
    """Each sample as a feed of the file's inputs (in their order, as the peers bind them)."""
    init = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in init]
    return [dict(zip(names, sample, strict=True)) for sample in samples]


def _static_shapes(model: onnx.ModelProto, feed: dict) -> onnx.ModelProto:
    """``model`` with its inputs' open dimensions fixed to the sample's (the calibrators run
    shape inference, which open axes defeat)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for inp in model.graph.input:
        if inp.name in feed:
            dims = inp.type.tensor_type.shape.dim
            for d, n in zip(dims, feed[inp.name].shape, strict=True):
                d.ClearField("dim_param")
                d.dim_value = int(n)
    return model


def onnxruntime_int8(data: bytes, q: QuantizationData) -> bytes:
    """The file quantized by onnxruntime's ``quantize_static`` on the calibration samples (QDQ,
    per-channel weights), as a user of onnxruntime does it."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    model = onnx.load_from_string(data)
    feeds = _feeds(model, q.calibration)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> dict | None:
            return next(self.left, None)

    with tempfile.TemporaryDirectory(prefix="partune-ort-int8-") as folder:
        src, out = Path(folder) / "f32.onnx", Path(folder) / "int8.onnx"
        onnx.save(_static_shapes(model, feeds[0]), src)
        quantize_static(
            str(src),
            str(out),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            reduce_range=_without_vnni(),
        )
        return out.read_bytes()


def _nncf_parameters():
    """NNCF's advanced parameters as its guide sets them for this CPU (``OverflowFix``)."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    fix = OverflowFix.ENABLE if _without_vnni() else OverflowFix.FIRST_LAYER
    return AdvancedQuantizationParameters(overflow_fix=fix)


def _saved(model: onnx.ModelProto) -> bytes:
    buf = io.BytesIO()
    onnx.save(model, buf)
    return buf.getvalue()


def nncf_int8(data: bytes, q: QuantizationData) -> bytes:
    """The file quantized by NNCF's ``quantize`` on the calibration samples (its ONNX backend:
    the QDQ file OpenVINO then runs on its int8 kernels), as a user of OpenVINO does it."""
    import nncf

    model = onnx.load_from_string(data)
    feeds = _feeds(model, q.calibration)
    return _saved(
        nncf.quantize(
            _static_shapes(model, feeds[0]),
            nncf.Dataset(feeds),
            subset_size=len(feeds),
            advanced_parameters=_nncf_parameters(),
        )
    )


def _validation_fn(data: bytes, q: QuantizationData) -> Callable:
    """NNCF's ``validation_fn`` for ``q``: a model's score on the validation samples it is
    handed (their indices), ``1 - error`` against the f32 file in OpenVINO, with each sample's
    score (NNCF ranks the layers to revert by the per-sample scores). NNCF reads the budget as
    an absolute drop from the f32 model's score of 1, so a drop of ``tolerance`` is an error of
    ``tolerance``. The last model compiled is kept: NNCF asks again per sample."""
    from partune.backends import open_model_file
    from partune.runners.accuracy import metric_error

    inputs, threads = q.validation[0], os.cpu_count() or 1  # untimed: every core
    reference = open_model_file("openvino", data, inputs, threads)
    expected = [reference(s) for s in q.validation]
    compiled: dict[int, tuple[onnx.ModelProto, Callable]] = {}

    def validate(model: onnx.ModelProto, indices) -> tuple[float, list[float]]:
        if id(model) not in compiled:
            compiled.clear()  # the model object stays referenced, so its id is not reused
            compiled[id(model)] = (model, _compiled(_saved(model), inputs, threads))
        run = compiled[id(model)][1]
        got = [(run(q.validation[i]), expected[i]) for i in (int(i) for i in indices)]
        scores = [1.0 - metric_error(q.metric, [y], [r]) for y, r in got]
        whole = metric_error(q.metric, [y for y, _ in got], [r for _, r in got])
        return 1.0 - whole, scores

    return validate


def _compiled(data: bytes, inputs: list[np.ndarray], threads: int) -> Callable:
    """``data`` compiled by OpenVINO; where its CPU plugin cannot compile one of the models NNCF
    ranks layers on (on distilbert: "constant_fold" of a Convert failed, for a model with some
    quantizers taken out), by onnxruntime, which runs the same QDQ file. The model NNCF returns
    is timed under OpenVINO all the same (and is unavailable where it fails there)."""
    from partune.backends import ModelFileError, open_model_file

    try:
        return open_model_file("openvino", data, inputs, threads)
    except ModelFileError:
        return open_model_file("onnxruntime", data, inputs, threads)


def nncf_accuracy_control(data: bytes, q: QuantizationData) -> bytes:
    """The file quantized by NNCF's ``quantize_with_accuracy_control``: quantized on the
    calibration samples, then reverted toward f32 until ``q.metric`` on the validation samples
    is within ``q.tolerance`` (the strongest int8 a user of OpenVINO gets within a budget)."""
    import nncf

    model = onnx.load_from_string(data)
    feeds = _feeds(model, q.calibration)
    indices = list(range(len(q.validation)))
    checked = _validation_fn(data, q)
    return _saved(
        nncf.quantize_with_accuracy_control(
            _static_shapes(model, feeds[0]),
            nncf.Dataset(feeds),
            nncf.Dataset(indices, lambda i: _feeds(model, [q.validation[i]])[0]),
            checked,
            max_drop=q.tolerance,
            subset_size=len(feeds),
            advanced_quantization_parameters=_nncf_parameters(),
        )
    )


QUANTIZERS: dict[str, Callable[[bytes, QuantizationData], bytes]] = {
    "onnxruntime int8": onnxruntime_int8,
    "openvino int8": nncf_int8,
    ACCURACY_CONTROL: nncf_accuracy_control,
}
QUANTIZER_PACKAGES = {"onnxruntime int8": "onnxruntime", "openvino int8": "nncf"} | {
    ACCURACY_CONTROL: "nncf"
}


def quantizer_version(kind: str) -> str:
    """The tool that quantizes for the int8 peer ``kind``, with its installed version ("nncf
    2.19.0"): another version may quantize the same file otherwise."""
    from importlib.metadata import version

    package = QUANTIZER_PACKAGES[kind]
    return f"{package} {version(package)}"


def quantize_file(kind: str, data: bytes, q: QuantizationData) -> bytes:
    """``data`` (ONNX bytes) quantized as the int8 peer ``kind`` does it, on ``q``."""
    return QUANTIZERS[kind](data, q)
