"""A whole model's TVM JSON written to a file once, which requests name instead of carrying it.

At 12 BERT-768 layers the model's JSON is 0.58 GB. Carried inside each plan and comparison
request, it was escaped by ``json.dumps``, encoded, piped, decoded and parsed again for every
request, a copy or more of the whole model at each step, on both sides of the pipe. A local
worker reads the file instead, and keeps the last model it parsed while the file stays as it
was; a remote worker cannot read this machine's files, so the RPC runner puts the text back
into the request (``inlined``), and the peers' ONNX files (``partune.runners.peers``) likewise.
"""

from __future__ import annotations

import base64
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from partune.runners.protocol import CompareRequest, PlanRequest, Request

_PARSED: dict[tuple[str, int, int], Any] = {}  # (path, mtime, size) -> its IRModule; one kept


def write(mod: Any, folder: str | Path) -> Path:
    """Write ``mod`` (a ``tvm.IRModule``) as TVM JSON into ``folder``; the file's path (what
    ``partune.runners.builder``'s requests take for the model's text)."""
    import tvm

    path = Path(folder) / f"model-{os.getpid()}-{id(mod):x}.json"
    path.write_text(tvm.ir.save_json(mod))
    return path


def inlined(request: Request) -> Request:
    """``request`` with the files it names inlined, for a worker elsewhere: the model's text,
    and the peers' ONNX files (``partune.runners.peers``) as base64."""
    if isinstance(request, (PlanRequest, CompareRequest)) and request.module_file is not None:
        request = replace(request, module=Path(request.module_file).read_text(), module_file=None)
    if isinstance(request, CompareRequest) and any(isinstance(c, dict) and "onnx_file" in c
                                                   for c in request.contenders.values()):
        request = replace(request, contenders={label: _inline_onnx(c) for label, c in request.contenders.items()})
    return request


def _inline_onnx(contender: Any) -> Any:
    if not isinstance(contender, dict) or "onnx_file" not in contender:
        return contender
    data = base64.b64encode(Path(contender["onnx_file"]).read_bytes()).decode()
    return {k: v for k, v in contender.items() if k != "onnx_file"} | {"onnx": data}


def load(request: PlanRequest | CompareRequest) -> Any:
    """The request's whole model as a ``tvm.IRModule``: from its file (parsed once while the
    file is unchanged) or from its text."""
    import tvm

    if request.module_file is None:
        return tvm.ir.load_json(request.module)
    stat = os.stat(request.module_file)
    key = (request.module_file, stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED:
        _PARSED.clear()  # the model searched before this one
        _PARSED[key] = tvm.ir.load_json(Path(request.module_file).read_text())
    return _PARSED[key]


def forget() -> None:
    """Drop the model parsed last (a comparison whose plans are all built needs it no more)."""
    _PARSED.clear()
