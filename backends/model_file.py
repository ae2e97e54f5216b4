"""The user's own ONNX file, run whole by one graph-level library: a peer, and a plan.

A user who has Partune has onnxruntime and OpenVINO, and can run their file under either
directly. That is the bar a plan must clear, so the search times exactly this code as a
peer, and when no partitioned plan beats it, this is what is emitted, exported and
deployed: a plan is never slower than the best library on the user's own file.

Both libraries are set up the way a careful user would: f32, all graph optimisations,
``threads`` intra-op threads, and for OpenVINO the LATENCY hint with the same settings as
the OpenVINO backend (``partune.backends.openvino_backend.compile_config``). Dynamic dimensions of
the file are fixed to the example inputs' shapes (OpenVINO compiles a static model then,
as it would for a user who reshapes; onnxruntime needs nothing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LIBRARIES = ("onnxruntime", "openvino")


def sha256(data: bytes) -> str:
    """The digest a plan records of the file it runs (a plan is for one file only)."""
    return hashlib.sha256(data).hexdigest()


class ModelFileError(RuntimeError):
    """The library cannot read or compile the file (its one-line reason)."""


@dataclass
class ModelFileRun:
    """A compiled whole model: ``run(feed)`` returns the outputs in the file's order."""

    library: str
    input_names: list[str]
    run: Callable[[list[np.ndarray]], list[np.ndarray]]

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return [np.array(o, copy=True) for o in self.run(inputs)]

    def prepare(self, inputs: list[np.ndarray]) -> Callable[[], object]:
        """A no-argument call on these inputs (for timing), as ``BuiltModel.prepare``."""
        inputs = [np.ascontiguousarray(a) for a in inputs]
        return lambda: self.run(inputs)


def open_model_file(
    library: str,
    data: bytes,
    inputs: list[np.ndarray] | None,
    threads: int,
    precision: str = "f32",
) -> ModelFileRun:
    """Compile ``data`` (ONNX bytes) with ``library`` for inputs shaped like ``inputs``, to
    compute in ``precision`` (bf16: OpenVINO only, as its CPU plugin does by default on
    CPUs with bf16 instructions). ``inputs`` None: the file's open dimensions stay open, and
    each call may bring other shapes (a deployment's fallback for shapes no plan serves)."""
    if library == "onnxruntime" and precision == "f32":
        return _onnxruntime(data, inputs, threads)
    if library == "openvino":
        return _openvino(data, inputs, threads, precision)
    if library in LIBRARIES:
        raise ModelFileError(f"{library} has no {precision} path")
    raise ModelFileError(f"{library} cannot run a model file (libraries: {', '.join(LIBRARIES)})")


def _first_line(e: BaseException) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _onnxruntime(data: bytes, inputs: list[np.ndarray] | None, threads: int) -> ModelFileRun:
    import onnxruntime as ort

    from partune.backends.onnxruntime_backend import session_options

    # The backend's options, but ORT's optimisers all on: what a user's session does.
    opts = session_options(threads, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    try:
        sess = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises several kinds
        raise ModelFileError(f"onnxruntime cannot load the file: {_first_line(e)}") from e
    names = [i.name for i in sess.get_inputs()]
    if inputs is not None and len(names) != len(inputs):
        raise ModelFileError(f"the file takes {len(names)} inputs, the model {len(inputs)}")

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return sess.run(None, dict(zip(names, arrays, strict=True)))

    return ModelFileRun("onnxruntime", names, run)


def openvino_model(data: bytes, inputs: list[np.ndarray] | None):
    """The file read by OpenVINO, its open dimensions set to ``inputs``' shapes (not compiled;
    ``inputs`` None: left open)."""
    import openvino as ov

    from partune.backends.openvino_backend import openvino_core

    model = openvino_core().read_model(data)
    if inputs is None:
        return model
    if len(model.inputs) != len(inputs):
        raise ModelFileError(f"the file takes {len(model.inputs)} inputs, the model {len(inputs)}")
    if model.is_dynamic():
        model.reshape(
            {
                port: ov.PartialShape(list(a.shape))
                for port, a in zip(model.inputs, inputs, strict=True)
            }
        )
    return model


def _openvino(
    data: bytes, inputs: list[np.ndarray] | None, threads: int, precision: str = "f32"
) -> ModelFileRun:
    from partune.backends.openvino_backend import compile_config, openvino_core

    try:
        compiled = openvino_core().compile_model(
            openvino_model(data, inputs), "CPU", compile_config(threads, precision)
        )
    except ModelFileError:
        raise
    except Exception as e:  # noqa: BLE001 - OpenVINO raises RuntimeError, OpConversionFailure, ...
        raise ModelFileError(f"openvino cannot read the file: {_first_line(e)}") from e
    request = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.inputs]

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return list(request.infer(arrays, share_inputs=True).values())

    return ModelFileRun("openvino", names, run)
