"""The user's own int8 tools on the user's own file: what an int8 plan must beat.

A user who wants int8 without Partune quantizes the whole model with the library's own tool,
on the same calibration data, and runs it in that library:

- onnxruntime's ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations, its
  default MinMax calibration), run by onnxruntime;
- NNCF's ``quantize`` (OpenVINO's post-training quantization, on the ONNX file), run by
  OpenVINO.

Both quantize every op they can, so their error is whatever it comes to. On a CPU without VNNI
each is given the setting its own guide prescribes against int16 saturation (onnxruntime's
``reduce_range``, NNCF's ``OverflowFix.ENABLE``: 7-bit weights; Partune's regions take the bit
from the activations instead, ``partune.core.int8``), so the peer is the strongest a user of
that tool would run. A peer over
the accuracy budget is timed and reported with its error, but is no bar to beat. The quantized
files are made in the search process (calibration runs the model, untimed) and timed like the
f32 peers (``partune.runners.peers``).
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

INT8_PEERS = ("onnxruntime int8", "openvino int8")


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


def onnxruntime_int8(data: bytes, samples: Sequence[Sequence[np.ndarray]]) -> bytes:
    """The file quantized by onnxruntime's ``quantize_static`` on ``samples`` (QDQ, per-channel
    weights), as a user of onnxruntime does it."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    model = onnx.load_from_string(data)
    feeds = _feeds(model, samples)

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


def nncf_int8(data: bytes, samples: Sequence[Sequence[np.ndarray]]) -> bytes:
    """The file quantized by NNCF's ``quantize`` on ``samples`` (its ONNX backend: the QDQ file
    OpenVINO then runs on its int8 kernels), as a user of OpenVINO does it."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    model = onnx.load_from_string(data)
    feeds = _feeds(model, samples)
    fix = OverflowFix.ENABLE if _without_vnni() else OverflowFix.FIRST_LAYER
    quantized = nncf.quantize(
        _static_shapes(model, feeds[0]),
        nncf.Dataset(feeds),
        subset_size=len(feeds),
        advanced_parameters=AdvancedQuantizationParameters(overflow_fix=fix),
    )
    buf = io.BytesIO()
    onnx.save(quantized, buf)
    return buf.getvalue()


QUANTIZERS = {"onnxruntime int8": onnxruntime_int8, "openvino int8": nncf_int8}
