"""The tools a user would pick instead of Partune, run under the same timing protocol.

``partune bench`` measures these beside Partune's plans in one run, so every ratio it
prints compares numbers taken on the same machine at the same time.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import numpy as np

from search.errors import last_line

Runnable = Callable[[], object]


def _torch_args(inputs: list[np.ndarray]):
    import torch

    return tuple(torch.from_numpy(a) for a in inputs)


def torch_eager(module, inputs: list[np.ndarray], threads: int) -> Runnable:
    import torch

    torch.set_num_threads(threads)
    args = _torch_args(inputs)

    def run():
        with torch.inference_mode():
            return module(*args)

    return run


def torch_compile(module, inputs: list[np.ndarray], threads: int) -> Runnable:
    """torch.compile (inductor, default mode); compiled once here, before timing."""
    import torch

    torch.set_num_threads(threads)
    compiled = torch.compile(module)
    args = _torch_args(inputs)

    def run():
        with torch.inference_mode():
            return compiled(*args)

    run()  # compile outside the timed region
    return run


def onnx_export(module, inputs: list[np.ndarray]) -> bytes:
    """The model exported the way a user would: ``torch.onnx.export`` (dynamo exporter)."""
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, _torch_args(inputs), dynamo=True, verbose=False)
        prog.save(buf) if hasattr(prog, "save") else None
    data = buf.getvalue()
    if not data:
        raise RuntimeError("torch.onnx.export produced no model")
    return data


def onnxruntime_session(onnx_bytes: bytes, inputs: list[np.ndarray], threads: int) -> Runnable:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(onnx_bytes, opts, providers=["CPUExecutionProvider"])
    feed = {i.name: a for i, a in zip(sess.get_inputs(), inputs, strict=True)}
    return lambda: sess.run(None, feed)


# Peers travel to the measuring process as specs: what to build there, next to the plans.
PEER_LABELS = {"onnxruntime": "onnxruntime", "torch.compile": "torch.compile (inductor)",
               "torch": "torch eager"}


def peer_label(kind: str, model) -> str:
    """How a peer is named in tables: onnxruntime says which ONNX graph it ran."""
    if kind == "onnxruntime":
        return "onnxruntime (your .onnx file)" if model.onnx_bytes is not None else "onnxruntime (torch.onnx.export)"
    return PEER_LABELS[kind]


def peer_specs(model, wanted: tuple[str, ...] = ("onnxruntime", "torch.compile")) -> dict[str, dict]:
    """Specs of the peers a user of ``model`` would pick instead of Partune.

    onnxruntime runs the user's own ONNX file when the model came as one, else a
    ``torch.onnx.export`` of the torch module; the torch peers need the module. A peer
    that cannot be packaged (an export that fails) is left out with its reason.
    """
    import base64

    specs: dict[str, dict] = {}
    tm = model.torch_module
    if "onnxruntime" in wanted and (model.onnx_bytes is not None or tm is not None):
        try:
            data = model.onnx_bytes or onnx_export(tm, model.inputs)
            specs[peer_label("onnxruntime", model)] = {"kind": "onnxruntime",
                                                        "onnx": base64.b64encode(data).decode()}
        except Exception as e:  # noqa: BLE001 - the exporter raises many kinds
            specs[peer_label("onnxruntime", model)] = {"kind": "unavailable",
                                                        "why": f"torch.onnx.export: {last_line(e, 160)}"}
    for kind in ("torch.compile", "torch"):
        if kind in wanted and tm is not None:
            try:
                specs[peer_label(kind, model)] = {"kind": kind,
                                                  "module": base64.b64encode(_pickle_module(tm)).decode()}
            except Exception as e:  # noqa: BLE001 - unpicklable modules
                specs[peer_label(kind, model)] = {"kind": "unavailable",
                                                  "why": f"cannot ship the module: {last_line(e, 160)}"}
    return specs


def make_peer(spec: dict, inputs: list[np.ndarray], threads: int) -> Runnable:
    """Build a peer from its spec, ready to time (compilation happens here, untimed)."""
    import base64

    if spec["kind"] == "onnxruntime":
        return onnxruntime_session(base64.b64decode(spec["onnx"]), inputs, threads)
    if spec["kind"] in ("torch", "torch.compile"):
        import torch

        module = torch.load(io.BytesIO(base64.b64decode(spec["module"])), weights_only=False)
        make = torch_compile if spec["kind"] == "torch.compile" else torch_eager
        return make(module, inputs, threads)
    raise RuntimeError(spec.get("why", f"unknown peer kind {spec['kind']}"))


def _pickle_module(module) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()
