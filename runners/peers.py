"""The tools a user would pick instead of Partune, run under the same timing protocol.

``partune bench`` measures these beside Partune's plans in one run, so every ratio it
prints compares numbers taken on the same machine at the same time.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import numpy as np

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
