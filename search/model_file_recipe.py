"""The ONNX bytes a model-file plan runs, made again wherever the plan is exported or run.

A model-file plan (``partune.core.ModelFile``) runs the model's own file under one library,
or that file quantized by an int8 peer's tool where that peer, within the accuracy budget,
beat every partitioned plan. The plan keeps the recipe of a quantized file, not its bytes
(tens of megabytes in a plan or a store, for a file its tool makes again in seconds): the
tool and its version, the metric and budget, and a digest of the samples. The tools are
deterministic, so the same recipe gives the file the verdict timed; a recipe that cannot be
followed here (another tool version, other samples) is refused, never approximated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from partune.core import ModelFile, PlanError
from partune.runners import check_source, model_onnx, quantize_file, quantizer_version
from partune.search.int8_calibration import quantization_data
from partune.search.options import TuneOptions

if TYPE_CHECKING:
    from partune.frontend import Model


def model_file_data(model: Model, file: ModelFile, options: TuneOptions | None = None) -> bytes:
    """The bytes ``file`` runs for ``model``: its ONNX graph (``model_onnx``, checked against
    the file the plan was made for), quantized again where the plan names a quantizer, on the
    samples of ``options`` (``calibration``, ``validation``; none: the synthetic ones the search
    drew). Raises PlanError where the quantized file would not be the one timed."""
    data = model_onnx(model)
    check_source(file, data)
    if file.quantizer is None:
        return data
    here = quantizer_version(file.quantizer)
    if here != file.quantized_with:
        raise PlanError(
            f"the plan's file was quantized by {file.quantized_with}, this machine has {here}: "
            "tune again here, or install that version"
        )
    options = replace(options or TuneOptions(), metric=file.metric, tolerance=file.tolerance)
    q = quantization_data(model, options)
    if q.digest != file.quantized_on:
        raise PlanError(
            f"the plan's file was quantized on other samples (digest {file.quantized_on}, "
            f"these are {q.digest}): give the --calibration and --validation the tuning job had"
        )
    return quantize_file(file.quantizer, data, q)


def quantized_model_file(
    library: str, origin: str, sha256: str | None, kind: str, model: Model, options: TuneOptions
) -> ModelFile:
    """The model-file plan of the int8 peer ``kind`` (quantized on what the search's peers were,
    ``quantization_data``), with its recipe."""
    q = quantization_data(model, options)
    return ModelFile(
        library,
        origin,
        sha256,
        quantizer=kind,
        quantized_with=quantizer_version(kind),
        quantized_on=q.digest,
        metric=q.metric,
        tolerance=q.tolerance,
    )
