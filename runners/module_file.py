"""A whole model written to files once, which requests name instead of carrying it.

At 12 BERT-768 layers the model's TVM JSON is 0.58 GB, most of it its weights as base64.
Carried inside each plan and comparison request, it was escaped by ``json.dumps``, encoded,
piped, decoded and parsed again for every request, a copy or more of the whole model at each
step, on both sides of the pipe. Now the model's large constants are lifted out into a binary
parameter file (``tvm.runtime.save_param_dict_to_file``: no base64, no text copies of the
weights in the search process, 9 s of ``save_json`` less at 12 layers), and its structure
goes into a small JSON file beside it. A local worker reads both and binds the constants back
(``load``), and keeps the last model it built while the files stay as they were; a remote
worker cannot read this machine's files, so the RPC runner puts the whole model's text back
into the request (``inlined``), and the peers' ONNX files (``partune.runners.peers``) likewise.
"""

from __future__ import annotations

import base64
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from partune.runners.protocol import (
    BuildRequest,
    CaptureRequest,
    CompareRequest,
    ModelRef,
    PlanRequest,
    RegionRequest,
    Request,
)

_PARSED: dict[
    tuple[str, int, int], dict[str, Any]
] = {}  # (path, mtime, size) -> its IRModule (and graph); one kept
LIFTED = (
    4096  # bytes: a constant this large goes to the parameter file, smaller ones stay in the JSON
)
_PREFIX = "__partune_const_"  # the parameters that stand for lifted constants


def write(mod: Any, folder: str | Path) -> Path:
    """Write ``mod`` (a ``tvm.IRModule``) into ``folder``: its large constants to a parameter
    file, the rest as TVM JSON. The JSON file's path (what ``partune.runners.builder``'s
    requests take for the model's text); the parameter file lies beside it (``_params_of``)."""
    import tvm

    path = Path(folder) / f"model-{os.getpid()}-{id(mod):x}.json"
    structure, params = lift_constants(mod)
    if params:
        tvm.runtime.save_param_dict_to_file(params, str(_params_of(path)))
    path.write_text(tvm.ir.save_json(structure))
    return path


def read(path: str | Path) -> Any:
    """The model ``write`` wrote at ``path``, its constants bound back."""
    import tvm

    mod = tvm.ir.load_json(Path(path).read_text())
    params = _params_of(Path(path))
    return (
        bind_constants(mod, tvm.runtime.load_param_dict_from_file(str(params)))
        if params.exists()
        else mod
    )


def _params_of(path: Path) -> Path:
    return path.with_suffix(".params")


def lift_constants(mod: Any) -> tuple[Any, dict[str, Any]]:
    """``mod`` with each constant of ``LIFTED`` bytes or more turned into a new trailing
    parameter of its function, and those constants by parameter name. ``bind_constants``
    undoes it: the result is structurally equal to ``mod``, and its dataflow graph the same."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class _Lift(relax.PyExprMutator):
        def __init__(self, params: dict[str, Any]) -> None:
            super().__init__(mod)
            self.params, self.new = params, []

        def visit_generic_const_(self, op: Any) -> Any:
            data = op.value
            if (
                int(tvm.runtime.DataType(data.dtype).bits)
                // 8
                * math.prod(int(d) for d in data.shape)
                < LIFTED
            ):
                return op
            var = relax.Var(f"{_PREFIX}{len(self.params)}", op.ty)
            self.params[var.name] = data
            self.new.append(var)
            return var

    params: dict[str, Any] = {}
    functions = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            lift = _Lift(params)
            body = lift.visit_expr(func.body)
            if lift.new:
                func = relax.Function(
                    [*func.params, *lift.new], body, None, func.is_pure, func.attrs, func.span
                )
        functions[gv] = func
    return (tvm.IRModule(functions, attrs=mod.attrs) if params else mod), params


def bind_constants(mod: Any, params: dict[str, Any]) -> Any:
    """``mod`` with the parameters ``lift_constants`` made bound to their constants again."""
    from tvm import relax

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mine = {
                p.name: params[p.name]
                for p in func.params
                if p.name.startswith(_PREFIX) and p.name in params
            }
            if mine:
                mod = relax.transform.BindParams(gv.name_hint, mine)(mod)
    return mod


def inlined(request: Request) -> Request:
    """``request`` with the files it names inlined, for a worker elsewhere: the model's text (a
    region's: its region's), and the peers' ONNX files (``partune.runners.peers``) as base64."""
    file = getattr(request, "module", None) and request.module.file  # type: ignore[union-attr]
    if isinstance(request, (PlanRequest, CompareRequest, CaptureRequest)) and file is not None:
        import tvm

        request = replace(request, module=ModelRef(text=tvm.ir.save_json(read(file))))
    if isinstance(request, RegionRequest) and file is not None:
        import tvm

        request = replace(request, module=ModelRef(text=tvm.ir.save_json(region(request))))
    if isinstance(request, CompareRequest) and any(
        isinstance(c, dict) and "onnx_file" in c for c in request.contenders.values()
    ):
        request = replace(
            request, contenders={label: _inline_onnx(c) for label, c in request.contenders.items()}
        )
    return request


def _inline_onnx(contender: Any) -> Any:
    """A peer's ONNX file (and an int8 peer's f32 ``reference``) carried in its spec."""
    if not isinstance(contender, dict) or "onnx_file" not in contender:
        return contender
    data = base64.b64encode(Path(contender["onnx_file"]).read_bytes()).decode()
    inlined = {k: v for k, v in contender.items() if k != "onnx_file"} | {"onnx": data}
    if "reference" in contender:
        inlined["reference"] = _inline_onnx(contender["reference"])
    return inlined


def load(request: PlanRequest | CompareRequest | CaptureRequest) -> Any:
    """The request's whole model as a ``tvm.IRModule``: from its files (read once while they
    are unchanged) or from its text."""
    import tvm

    if request.module.file is None:
        return tvm.ir.load_json(request.module.text)
    return _cached(request.module.file)["mod"]


def with_graph(request: CaptureRequest | RegionRequest | BuildRequest) -> tuple[Any, Any]:
    """The request's whole model and its ``DataflowGraph``; from a file, each made once while
    the file is unchanged (a capture and every region lifted from the model share them)."""
    from partune.core import DataflowGraph

    if request.module.file is None:
        mod = load(request)  # type: ignore[arg-type]
        return mod, DataflowGraph.from_function(mod["main"])
    model = _cached(request.module.file)
    if "graph" not in model:
        model["graph"] = DataflowGraph.from_function(model["mod"]["main"])
    return model["mod"], model["graph"]


def region(request: RegionRequest | BuildRequest) -> Any:
    """The region module (one function, ``region``) of a request that names its whole model's
    file: lifted here from the model (``partune.runners.builder.region_module``)."""
    from partune.runners.builder import region_module

    assert request.module.file is not None and request.module.nodes is not None
    return region_module(*with_graph(request), request.module.nodes)


def _cached(path: str) -> dict[str, Any]:
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _PARSED:
        _PARSED.clear()  # the model searched before this one
        _PARSED[key] = {"mod": read(path)}
    return _PARSED[key]


def forget() -> None:
    """Drop the model parsed last (a comparison whose plans are all built needs it no more)."""
    _PARSED.clear()
