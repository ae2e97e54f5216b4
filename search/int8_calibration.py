"""The ranges an int8 plan quantizes its activations over, measured once per model and data.

An int8 region quantizes the activation each of its matmuls and convolutions reads, and a
convolution's result (``partune.core.int8``). Their ranges come from the model's own values on
the calibration data: the model is run whole on each sample (``Runner.captured``, the capture
the candidates' inputs come from) and every such tensor's smallest and largest value is kept.
That is done once for the model and the data, whatever regions the search then tries, and
kept in the storage (``partune.store.Notes``) under a digest of both, so a resumed search or a
second worker reads it instead of running the model again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tvm import relax

from partune.core import (
    INT8_SCHEME,
    Calibration,
    attention_sources,
    draw_like,
    int8_units,
    main_bindings,
    unit_chain,
)
from partune.runners import QuantizationData, Validation, held_out_inputs
from partune.store import Notes

if TYPE_CHECKING:
    from partune.frontend import Model
    from partune.search.options import TuneOptions
    from partune.search.session_view import SessionView

SYNTHETIC_SAMPLES = 4  # int8 calibrated on the model's inputs and three draws like them


def calibration_samples(model: Model, options: TuneOptions) -> list[list[np.ndarray]]:
    """What int8 is calibrated on: the user's samples, else the model's inputs and draws like
    them (never the held-out set the plans' errors are judged on)."""
    if options.calibration:
        return list(options.calibration)
    inputs = list(model.inputs)
    return [inputs] + [draw_like(inputs, seed) for seed in range(1, SYNTHETIC_SAMPLES)]


def validation_for(model: Model, options: TuneOptions) -> Validation | None:
    """What reduced-precision errors are judged on: the user's validation samples, else
    (another metric than the default) the inputs and the held-out draw like them; None: as
    the runners judge by default (the same samples, by relative error)."""
    samples = list(options.validation)
    if not samples and options.metric != "rel":
        samples = [model.inputs, held_out_inputs(model.inputs)]
    return Validation.of(samples, options.metric) if samples else None


def quantization_data(model: Model, options: TuneOptions) -> QuantizationData:
    """What the int8 peers are quantized on and held to: the samples int8 is calibrated on,
    and the samples (``validation_for``, else the inputs and the held-out draw), metric and
    budget the plans are judged by."""
    validation = validation_for(model, options)
    judged = (
        validation.arrays()
        if validation is not None
        else [list(model.inputs), held_out_inputs(model.inputs)]
    )
    return QuantizationData(
        calibration_samples(model, options), judged, options.metric, options.accuracy_budget
    )


def calibrated_tensors(func: relax.Function) -> dict[relax.Var, str]:
    """The tensors of ``func`` (main) an int8 region quantizes, by their range names (``n<i>`` a
    binding's value, ``p<i>`` a parameter): the activation each quantizable matmul or convolution
    reads, and every value along its unit (``int8_units``; a region may cut the unit anywhere,
    and quantizes its output where it ends)."""
    bindings = main_bindings(func)
    name = {b.var: f"n{i}" for i, b in enumerate(bindings)} | {
        p: f"p{i}" for i, p in enumerate(func.params)
    }
    out: dict[relax.Var, str] = {}
    for i, end in int8_units(bindings).items():
        arg = bindings[i].value.args[0]
        if isinstance(arg, relax.Var) and arg in name:
            out[arg] = name[arg]
        for k in unit_chain(bindings, i, end):
            out[bindings[k].var] = name[bindings[k].var]
    for i in attention_sources(bindings):  # where OpenVINO's regions quantize attention
        out[bindings[i].var] = name[bindings[i].var]
    return out


def data_digest(fingerprint: str, samples: Sequence[Sequence[np.ndarray]]) -> str:
    """A name for the calibration of the model ``fingerprint`` on ``samples`` (their bytes), in
    this quantization scheme (``INT8_SCHEME``)."""
    h = hashlib.sha256((fingerprint + INT8_SCHEME).encode())
    for sample in samples:
        for a in sample:
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def ranges_over(
    values_per_sample: Sequence[dict], tensors: dict[relax.Var, str]
) -> dict[str, tuple[float, float]]:
    """Each tensor's smallest and largest finite value over all samples' captured values."""
    ranges: dict[str, tuple[float, float]] = {}
    for values in values_per_sample:
        for var, key in tensors.items():
            a = values.get(var)
            if not isinstance(a, np.ndarray) or a.size == 0:
                continue
            finite = a[np.isfinite(a)]
            if finite.size == 0:
                continue
            lo, hi = float(finite.min()), float(finite.max())
            old = ranges.get(key)
            ranges[key] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return ranges


def calibrate_int8(s: SessionView, samples: Sequence[list[np.ndarray]]) -> Calibration:
    """The model's int8 calibration on ``samples``: read from the storage, else measured (one
    capture of the whole model a sample) and kept there."""
    digest = data_digest(s.graph.fingerprint, samples)
    notes = Notes(s.store.storage)
    if (kept := notes.get("int8-ranges:" + digest)) is not None:
        return Calibration.from_json(kept)
    tensors = calibrated_tensors(s.mod["main"])
    s.progress.start_phase("calibrate int8 ranges", len(samples))
    captured = []
    for sample in samples:
        captured.append(
            {
                v: a
                for v, a in s.runner.captured(
                    s.mod,
                    s.graph,
                    list(sample),
                    s.backends,
                    s.module_file if s.runner.reads_local_files else None,
                ).items()
                if v in tensors
            }
        )
        s.progress.advance(f"{len(captured)} of {len(samples)} samples")
    calibration = Calibration(digest, ranges_over(captured, tensors))
    notes.put("int8-ranges:" + digest, calibration.to_json())
    return calibration
