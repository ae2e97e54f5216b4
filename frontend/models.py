"""Model import: zoo names, ONNX files, torch ExportedProgram files, TVMScript Relax files.

Every route ends in the same place: a Relax IRModule with static shapes and weights bound
as constants, example inputs, and a reference output computed by the model's own
framework (torch eager for zoo and .pt2 models, onnxruntime for ONNX, the untuned TVM
build for TVMScript), so any plan can be checked against it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from partune.core import (
    DataflowGraph,
    ModelError,
    SEScope,
    flatten_outputs,
    last_line,
    random_array,
    trim,
)
from partune.frontend.onnx_folding import explicit_conv_pads, fold_onnx_shapes
from partune.frontend.pipeline import PassRun, check_pass_names, normalise
from partune.frontend.shapes import axis_default

SEED = 0


@dataclass
class Model:
    """An imported model ready for partitioning and its reference."""

    name: str
    mod: tvm.IRModule
    inputs: list[np.ndarray]
    reference: list[np.ndarray]
    reference_source: str
    torch_module: object | None = None  # for the torch peers in `partune bench`
    torch_recipe: dict | None = None  # how a measuring process rebuilds it: runners/peers.py
    onnx_file: Path | None = None  # the user's ONNX file, self-contained: the library peers run it
    onnx_data: bytes | None = None  # ... or, where it keeps weights in files of their own, inlined
    onnx_sha256: str | None = None  # of ``onnx_bytes``: a model-file plan runs this file only
    hints: dict[str, SEScope] = field(default_factory=dict)  # var name -> R.hint_on_device scope
    assumed: list[str] = field(default_factory=list)  # input dimensions the file left open
    passes: list[PassRun] = field(default_factory=list)  # what each import pass did
    graph: DataflowGraph = field(init=False)

    def __post_init__(self) -> None:
        self.graph = DataflowGraph.from_function(self.mod["main"])

    @property
    def onnx_bytes(self) -> bytes | None:
        """The user's ONNX model, read when a peer or an export needs it: a search does not
        hold it (0.44 GB of a BERT-base search's resident size)."""
        return self.onnx_data if self.onnx_file is None else self.onnx_file.read_bytes()

    @property
    def pins(self) -> dict[int, SEScope]:
        """Nodes the model itself pins to a device (``R.hint_on_device`` in TVMScript)."""
        return {n.index: self.hints[n.name] for n in self.graph.nodes if n.name in self.hints}


DEVICE_TYPES = {1: "cpu", 2: "cuda", 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm"}


@relax.expr_functor.mutator
class _HintsToPins(relax.PyExprMutator):
    """``y = R.hint_on_device(x, dev)`` pins x's producer to dev, then becomes ``y = x``.

    Device planning keeps pinned nodes on their scope; the hint itself has no lowering.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hints: dict[str, SEScope] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.hint_on_device":
            dev = int(call.attrs.device_type)
            arg = call.args[0]
            if isinstance(arg, relax.Var):
                self.hints[arg.name] = SEScope(
                    device_type=DEVICE_TYPES.get(dev, str(dev)),
                    virtual_device_id=int(call.attrs.index),
                )
            return self.visit_expr(arg)
        return super().visit_call_(call)


def _strip_hints(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, SEScope]]:
    mutator = _HintsToPins()
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["main"] = mutator.visit_expr(mod["main"])
    return mod, mutator.hints


def _from_torch(
    name: str, module, args: tuple, source: str, recipe: dict, disabled: tuple[str, ...]
) -> Model:
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    with torch.no_grad():
        reference = flatten_outputs(module(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, args)
    try:
        mod = from_exported_program(ep)
    except Exception as e:  # the frontend raises many kinds
        raise ModelError(f"cannot import {name} to Relax: {str(e).splitlines()[-1][:200]}") from e
    mod, passes = normalise(mod, disabled)
    return Model(
        name, mod, [a.numpy() for a in args], reference, source, module, recipe, passes=passes
    )


def load_zoo(name: str, disabled: tuple[str, ...] = ()) -> Model:
    from partune.frontend.zoo import ZOO, names

    if name not in ZOO:
        raise ModelError(
            f"unknown model '{name}': not a file and not in the zoo ({', '.join(names())})"
        )
    entry = ZOO[name]
    return _from_torch(name, entry.build(), entry.inputs(), "torch eager", {"zoo": name}, disabled)


def _random_input(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    return random_array(shape, dtype, np.random.default_rng(seed))


def load_pt2(path: Path, disabled: tuple[str, ...] = ()) -> Model:
    import torch

    from partune.frontend.exported_program import load_program

    try:
        data = path.read_bytes()
        ep = load_program(data)
    except Exception as e:
        raise ModelError(
            f"cannot read ExportedProgram {path}: {str(e).splitlines()[0][:200]}"
        ) from e
    args = getattr(ep, "example_inputs", None)
    if args and args[0]:
        inputs = tuple(args[0])
    else:
        metas = [
            n.meta["val"]
            for n in ep.graph.nodes
            if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs
        ]
        inputs = tuple(
            torch.from_numpy(
                _random_input(tuple(m.shape), str(m.dtype).removeprefix("torch."), SEED + i)
            )
            for i, m in enumerate(metas)
        )
    recipe = {"pt2": base64.b64encode(data).decode()}
    return _from_torch(
        path.stem, ep.module(), inputs, "torch eager (ExportedProgram)", recipe, disabled
    )


def _read_onnx(path: Path):
    """The model as the user gave it, external weight files included; and whether it had any."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    try:
        proto = onnx.load(str(path), load_external_data=False)
        external = any(uses_external_data(t) for t in proto.graph.initializer)
        if external:
            load_external_data_for_model(proto, str(path.parent))
        onnx.checker.check_model(proto)
    except Exception as e:
        raise ModelError(
            f"cannot read ONNX model {path}: {str(e).strip().splitlines()[0][:200]}"
        ) from e
    return proto, external


def _reference(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The user's file run by onnxruntime: the outputs plans are checked against. The
    session (its own copy of the weights) is gone before the import makes more copies."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return flatten_outputs(sess.run(None, feeds))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own kinds
        raise ModelError(
            f"onnxruntime cannot run {path}: {str(e).strip().splitlines()[0][:200]}"
        ) from e


def _fix_input_shapes(
    proto, given: dict[str, tuple[int, ...]], assumed: list[str]
) -> dict[str, tuple[int, ...]]:
    """Static input shapes: the search works on them. ``given`` wins; another symbolic dim takes
    its default (``partune.frontend.shapes.axis_default``: 128 for a sequence, else 1).

    Every dimension assumed is described in ``assumed``, so the user learns which shape was
    tuned and how to set another.
    """
    init_names = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in init_names]
    if unknown := set(given) - {i.name for i in inputs}:
        raise ModelError(
            f"--input-shape names no input of the model: {', '.join(sorted(unknown))} "
            f"(inputs: {', '.join(i.name for i in inputs)})"
        )
    # A named dimension set on one input (sequence=128) holds for every input that names it.
    named = {
        d.dim_param: w
        for i in inputs
        if i.name in given
        for d, w in zip(i.type.tensor_type.shape.dim, given[i.name], strict=False)
        if d.dim_param
    }
    shapes = {}
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if inp.name not in given and all(d.dim_value > 0 or d.dim_param in named for d in dims):
            given = given | {
                inp.name: tuple(
                    d.dim_value if d.dim_value > 0 else named[d.dim_param] for d in dims
                )
            }
        if inp.name in given:
            want = given[inp.name]
            fixed = [d.dim_value for d in dims]
            if len(want) != len(dims) or any(
                f > 0 and f != w for f, w in zip(fixed, want, strict=True)
            ):
                raise ModelError(
                    f"--input-shape {inp.name}={','.join(map(str, want))} does not fit "
                    f"its declared shape {[d.dim_value or d.dim_param or '?' for d in dims]}"
                )
            for d, w in zip(dims, want, strict=True):
                d.ClearField("dim_param")
                d.dim_value = w
        elif symbolic := [d.dim_param or "?" for d in dims if d.dim_value <= 0]:
            sizes = [axis_default(a) for a in symbolic]
            assumed.append(
                f"{inp.name}: "
                + ", ".join(f"{a} taken as {n}" for a, n in zip(symbolic, sizes, strict=True))
            )
            for d, n in zip((d for d in dims if d.dim_value <= 0), sizes, strict=True):
                d.ClearField("dim_param")
                d.dim_value = n
        shapes[inp.name] = tuple(d.dim_value for d in dims)
    return shapes


def _frontend_failure(e: Exception) -> str:
    """Which ONNX node the Relax frontend failed on, read off the traceback."""
    tb = e.__traceback__
    node = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_construct_nodes":
            node = tb.tb_frame.f_locals.get("node")
        tb = tb.tb_next
    why = last_line(e, 160)
    if node is not None:
        return f"op {node.op_type} (node '{node.name}') failed: {why}"
    return why


def load_onnx(
    path: Path,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    disabled: tuple[str, ...] = (),
) -> Model:
    import hashlib

    import onnx
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    from partune.backends import sha256  # the digest a model-file plan checks

    proto, external = _read_onnx(path)
    if external:  # what the peers run: the weights inlined (a file's bytes alone would lack them)
        user: dict = {"onnx_data": proto.SerializeToString()}
        digest = sha256(user["onnx_data"])
    else:  # the file itself, read again when a peer needs it
        user = {"onnx_file": path.resolve()}
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    assumed: list[str] = []
    shapes = _fix_input_shapes(proto, input_shapes or {}, assumed)
    init_names = {i.name for i in proto.graph.initializer}
    inputs = []
    for k, inp in enumerate(i for i in proto.graph.input if i.name not in init_names):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type).name
        inputs.append(_random_input(shapes[inp.name], dtype, SEED + k))
    reference = _reference(path, dict(zip(shapes, inputs, strict=True)))
    proto = explicit_conv_pads(fold_onnx_shapes(proto))
    unsupported = sorted(
        {n.op_type for n in proto.graph.node} - set(_get_convert_map()) - {"Constant", "If"}
    )
    if unsupported:
        raise ModelError(
            f"cannot import {path} to Relax: no Relax translation for ONNX op(s) "
            f"{', '.join(unsupported)}"
        )
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            mod = from_onnx(proto, shape_dict=shapes, keep_params_in_input=False)
    except Exception as e:  # the frontend raises many kinds
        raise ModelError(f"cannot import {path} to Relax: {_frontend_failure(e)}") from e
    del proto  # its weights are the module's constants now: one copy fewer while Relax normalises
    try:
        mod, passes = normalise(relax.transform.DecomposeOpsForInference()(mod), disabled)
        return Model(
            path.stem,
            mod,
            inputs,
            reference,
            "onnxruntime",
            onnx_sha256=digest,
            assumed=assumed,
            passes=passes,
            **user,
        )
    except Exception as e:  # noqa: BLE001 - what Relax cannot type or fold is bad input here
        raise ModelError(f"cannot import {path} to Relax: {_frontend_failure(e)}") from e


def load_tvmscript(path: Path, disabled: tuple[str, ...] = ()) -> Model:
    # The parser takes the module itself; import lines around it are for Python only.
    text = "\n".join(
        "" if re.match(r"(from|import)\s", line) else line for line in path.read_text().splitlines()
    )
    try:
        mod = tvm.script.from_source(text)
    except Exception as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ModelError(f"cannot parse TVMScript {path}: {first[:200]}") from e
    if not isinstance(mod, tvm.IRModule) or "main" not in [
        g.name_hint for g in mod.get_global_vars()
    ]:
        raise ModelError(f"{path} has no Relax function 'main'")
    func = mod["main"]
    inputs = []
    for k, p in enumerate(func.params):
        ty = p.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise ModelError(f"{path}: parameter '{p.name}' needs a static tensor shape")
        inputs.append(
            _random_input(tuple(int(v) for v in ty.shape.values), str(ty.dtype), SEED + k)
        )
    from partune.backends import (
        compile_module,  # the reference is the untuned TVM build
    )

    mod, hints = _strip_hints(mod)
    mod, passes = normalise(mod, disabled)
    try:
        ex = compile_module(mod, tvm.target.Target({"kind": "llvm"}))
        vm = relax.VirtualMachine(ex, tvm.cpu())
        reference = flatten_outputs(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))
    except Exception as e:  # noqa: BLE001 - TVM raises many kinds
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ModelError(f"cannot build TVMScript model {path} with TVM: {first[:200]}") from e
    return Model(path.stem, mod, inputs, reference, "untuned TVM", hints=hints, passes=passes)


LOADERS: dict[str, Callable[[Path, tuple[str, ...]], Model]] = {
    ".onnx": load_onnx,
    ".pt2": load_pt2,
    ".py": load_tvmscript,
    ".tvmscript": load_tvmscript,
    ".relax": load_tvmscript,
}


def load(
    spec: str,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    disabled_passes: Iterable[str] = (),
) -> Model:
    """A zoo name or a path to an .onnx, .pt2 or TVMScript (.py/.tvmscript/.relax) file.

    ``input_shapes`` fixes an ONNX model's symbolic input dimensions (batch, sequence);
    the other formats carry static shapes of their own. ``disabled_passes`` names import
    passes (``frontend.pipeline``) to leave out.

    An import's temporary copies (protobufs, onnxslim's rounds, the reference session) are
    handed back to the system before the search starts: they were half of the search
    process's resident size on BERT-768 at 2 layers (2.5 GB after loading, 1.3 GB trimmed).
    """
    try:
        return _load(spec, input_shapes, check_pass_names(disabled_passes))
    finally:
        trim()


def _load(
    spec: str, input_shapes: dict[str, tuple[int, ...]] | None, disabled: tuple[str, ...]
) -> Model:
    path = Path(spec)
    if input_shapes and path.suffix != ".onnx":
        raise ModelError(
            "--input-shape applies to ONNX models only (other formats have static shapes)"
        )
    if path.suffix == ".onnx" and path.is_file():
        return load_onnx(path, input_shapes, disabled)
    if path.suffix in LOADERS:
        if not path.is_file():
            raise ModelError(f"model file {spec} does not exist")
        return LOADERS[path.suffix](path, disabled)
    if path.exists():
        raise ModelError(
            f"cannot tell the format of {spec}: use .onnx, .pt2, .py/.tvmscript/.relax"
        )
    return load_zoo(spec, disabled)
