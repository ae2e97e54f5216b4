"""The tools a user would pick instead of Partune, run under the same timing protocol.

The verdict of ``partune tune`` and ``partune bench`` measure these beside Partune's plans
in one run, so every ratio printed compares numbers taken on the same machine at the same
time. onnxruntime and OpenVINO run the user's own ONNX file (or an export of the model)
through ``partune.backends.model_file``: the same code that runs a model-file plan, so when a
library on the user's file wins, the plan that says so is exactly what was timed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from partune.backends import LIBRARIES, open_model_file
from partune.core import last_line
from partune.frontend import load_program
from partune.runners.int8_peers import (
    ACCURACY_CONTROL,
    INT8_PEERS,
    QuantizationData,
    quantize_file,
)

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


def torch_compile(
    module, inputs: list[np.ndarray], threads: int, precision: str = "f32"
) -> Runnable:
    """torch.compile (inductor, default mode); compiled once here, before timing. ``bf16``: run
    under CPU autocast, as a torch user asks for bfloat16 (matmuls and convolutions in bf16)."""
    call = _compiled_call(module, threads, precision)
    args = _torch_args(inputs)

    def run():
        return call(args)

    run()  # compile outside the timed region
    return run


def _compiled_call(module, threads: int, precision: str) -> Callable[[tuple], object]:
    import torch

    torch.set_num_threads(threads)
    compiled = torch.compile(module)

    def call(args: tuple):
        with (
            torch.inference_mode(),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"),
        ):
            return compiled(*args)

    return call


def _torch_outputs(
    module, threads: int, precision: str
) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """The compiled module as a function of numpy inputs to float32 numpy outputs (for its
    error)."""
    import torch

    from partune.core import flatten_outputs

    call = _compiled_call(module, threads, precision)

    def run(inputs: list[np.ndarray]) -> list[np.ndarray]:
        out = torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            call(_torch_args(inputs)),
        )
        return flatten_outputs(out)

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


def user_onnx(model) -> bool:
    """Whether ``model`` came as an ONNX file (asked without reading it)."""
    return (
        getattr(model, "onnx_file", None) is not None
        or getattr(model, "onnx_data", None) is not None
    )


def model_origin(model) -> str:
    """Which ONNX graph the library peers run: the user's own file, else an export."""
    if user_onnx(model):
        return "your .onnx file"
    return "torch.onnx.export" if model.torch_module is not None else "Relax-to-ONNX export"


def model_onnx(model) -> bytes:
    """The ONNX graph a user of ``model`` would hand onnxruntime or OpenVINO: their own file,
    else ``torch.onnx.export`` of the torch module, else (a TVMScript model) the whole
    Relax module translated to ONNX. Raises with the reason when there is none."""
    if user_onnx(model):
        return model.onnx_bytes
    if model.torch_module is not None:
        return onnx_export(model.torch_module, model.inputs)
    from partune.backends import relax_to_onnx

    return relax_to_onnx(model.mod["main"]).SerializeToString()


# The peers: graph-level libraries on the model's ONNX graph (``partune.backends.model_file``, the
# very code a model-file plan deploys with), and torch on the module.
LIBRARY_PEERS = LIBRARIES
PEER_LABELS = {
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "torch.compile": "torch.compile (inductor)",
    "torch": "torch eager",
    "openvino bf16": "openvino bf16",
    "torch.compile bf16": "torch.compile bf16 (inductor, autocast)",
    "onnxruntime int8": "onnxruntime int8",  # quantize_static on the file (``int8_peers``)
    "openvino int8": "openvino int8",  # NNCF's quantize on the file
    ACCURACY_CONTROL: ACCURACY_CONTROL,  # NNCF's quantize_with_accuracy_control on the file
}
DEFAULT_PEERS = ("onnxruntime", "openvino", "torch.compile")
# With --precision bf16, the peers at that precision too: OpenVINO's bf16 (its own default on
# CPUs with bf16 instructions) and torch.compile under bf16 autocast, timed like the rest and
# reported with their errors.
BF16_PEERS = ("openvino bf16", "torch.compile bf16")


def _library(kind: str) -> bool:
    """Whether a peer kind runs the model's ONNX graph in a library (else torch runs the module)."""
    return kind.split()[0] in LIBRARY_PEERS


def _kind_fields(kind: str) -> dict[str, str]:
    """A peer kind as its spec spells it: what runs it, and a reduced precision ("openvino
    bf16"; "openvino int8 accuracy-control" computes in int8 too)."""
    runs, *precision = kind.split()
    return {"kind": runs} | ({"precision": precision[0]} if precision else {})


def peer_label(kind: str, model) -> str:
    """How a peer is named in tables: a library says which ONNX graph it ran."""
    if _library(kind):
        return f"{kind} ({model_origin(model)})"
    return PEER_LABELS[kind]


def peer_kind(label: str) -> str | None:
    """The peer kind of a label made by ``peer_label`` (None: not a peer's label)."""
    return next(
        (k for k in PEER_LABELS if label == PEER_LABELS[k] or label.startswith(f"{k} (")), None
    )


def peers_at(named: tuple[str, ...], precisions: tuple[str, ...]) -> tuple[str, ...]:
    """The peer kinds to time for the peers a user ``named`` when plans may take
    ``precisions``: with bf16 (int8) on offer, the bf16 (int8) peers of the libraries named
    come too, unless the user named peers of that precision themselves; then exactly those.
    (NNCF's accuracy control re-ranks every quantizer group, one OpenVINO compile each, after
    each revert that does not help: hours on a model with a hundred groups, so a user may
    leave it out by naming the int8 peers they want.)"""
    extra: tuple[str, ...] = ()
    for precision, group in (("bf16", BF16_PEERS), ("int8", INT8_PEERS)):
        if precision in precisions and not set(group) & set(named):
            extra += tuple(p for p in group if p.split()[0] in named)
    return named + extra


def available_peers(model, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The peer kinds of ``wanted`` that ``model`` can have at all (torch needs the module)."""
    return tuple(
        k for k in wanted if k in PEER_LABELS and (_library(k) or model.torch_module is not None)
    )


def peer_specs(
    model,
    wanted: tuple[str, ...] = DEFAULT_PEERS,
    folder: str | Path | None = None,
    quantization: QuantizationData | None = None,
) -> dict[str, dict]:
    """Specs of the peers a user of ``model`` would pick instead of Partune.

    onnxruntime and OpenVINO run ``model_onnx(model)``: the user's own file, else an export
    written into ``folder``, named by the specs (``onnx_file``; a remote worker gets it
    inlined, ``partune.runners.module_file``); without a folder, an export is carried in them
    as base64 (``onnx``), once per peer: at 24 BERT-768 layers that was 2 GB of request text,
    escaped and copied on both sides. The torch peers need the module.
    A peer that cannot be packaged (an export that fails) is an "unavailable" spec with
    its one-line reason; one the library cannot read fails where it is built. The int8 peers
    (``partune.runners.int8_peers``) are the file quantized here on ``quantization``, written into
    ``folder``, with the f32 file as their ``reference``.
    """
    specs: dict[str, dict] = {}
    libraries = [k for k in available_peers(model, wanted) if _library(k)]
    if libraries:
        try:
            if getattr(model, "onnx_file", None) is not None:  # the user's own file: no copy
                onnx = {"onnx_file": str(model.onnx_file)}
            elif folder is not None:
                path = Path(folder) / "peer.onnx"
                if not path.exists():
                    path.write_bytes(model_onnx(model))
                onnx = {"onnx_file": str(path)}
            else:
                onnx = {"onnx": base64.b64encode(model_onnx(model)).decode()}
            specs |= {
                peer_label(k, model): _kind_fields(k) | onnx
                for k in libraries
                if k not in INT8_PEERS
            }
            specs |= _int8_specs(model, libraries, onnx, folder, quantization)
        except Exception as e:  # noqa: BLE001 - the exporters raise many kinds
            why = f"{model_origin(model)}: {last_line(e, 160)}"
            specs |= {peer_label(k, model): {"kind": "unavailable", "why": why} for k in libraries}
    for kind in ("torch.compile", "torch", "torch.compile bf16"):
        if kind in available_peers(model, wanted):
            try:
                specs[peer_label(kind, model)] = _kind_fields(kind) | {
                    "module": torch_recipe(model)
                }
            except Exception as e:  # noqa: BLE001 - a module with no recipe
                specs[peer_label(kind, model)] = {
                    "kind": "unavailable",
                    "why": f"cannot ship the module: {last_line(e, 160)}",
                }
    return specs


def _int8_specs(
    model,
    libraries: list[str],
    onnx: dict,
    folder: str | Path | None,
    quantization: QuantizationData | None,
) -> dict[str, dict]:
    """The int8 peers asked for: the file quantized by each library's own tool (one line of
    why where it cannot be)."""
    specs: dict[str, dict] = {}
    for kind in (k for k in libraries if k in INT8_PEERS):
        label = peer_label(kind, model)
        try:
            if folder is None or quantization is None or not quantization.calibration:
                raise RuntimeError("no calibration data to quantize with")
            path = Path(folder) / f"peer.{kind.replace(' ', '-')}.onnx"
            if not path.exists():
                path.write_bytes(quantize_file(kind, _onnx_of(onnx), quantization))
            specs[label] = _kind_fields(kind) | {"onnx_file": str(path), "reference": onnx}
        except Exception as e:  # noqa: BLE001 - the quantizers raise many kinds
            specs[label] = {"kind": "unavailable", "why": f"cannot quantize: {last_line(e, 160)}"}
    return specs


def _compute_precision(spec: dict) -> str:
    """The precision a library compiles a peer's file in: an int8 file computes as it stands."""
    precision = spec.get("precision", "f32")
    return "f32" if precision == "int8" else precision


def make_peer(spec: dict, inputs: list[np.ndarray], threads: int) -> Runnable:
    """Build a peer from its spec, ready to time (compilation happens here, untimed)."""
    if spec["kind"] in LIBRARY_PEERS:
        return open_model_file(
            spec["kind"], _onnx_of(spec), inputs, threads, _compute_precision(spec)
        ).prepare(inputs)
    if spec["kind"] == "torch.compile":
        return torch_compile(
            rebuild_module(spec["module"]), inputs, threads, spec.get("precision", "f32")
        )
    if spec["kind"] == "torch":
        return torch_eager(rebuild_module(spec["module"]), inputs, threads)
    raise RuntimeError(spec.get("why", f"unknown peer kind {spec['kind']}"))


def _onnx_of(spec: dict) -> bytes:
    """A library peer's ONNX model: from its file, or from the spec itself."""
    return (
        Path(spec["onnx_file"]).read_bytes()
        if "onnx_file" in spec
        else base64.b64decode(spec["onnx"])
    )


def peer_error(spec: dict, inputs: list[np.ndarray], threads: int, validation=None) -> float | None:
    """A reduced-precision peer's relative error against the same library (or torch.compile) on
    the same model in f32 (an int8 peer's ``reference`` file; ``partune.runners.accuracy``);
    None for an f32 peer. ``validation``: the user's samples and metric, as for plans."""
    if spec.get("precision", "f32") == "f32":
        return None
    from partune.runners.accuracy import plan_error

    if spec["kind"] == "torch.compile":
        module = rebuild_module(spec["module"])
        return plan_error(
            _torch_outputs(module, threads, spec["precision"]),
            _torch_outputs(module, threads, "f32"),
            inputs,
            validation,
        )
    data = _onnx_of(spec)
    reference = _onnx_of(spec["reference"]) if "reference" in spec else data
    return plan_error(
        open_model_file(spec["kind"], data, inputs, threads, _compute_precision(spec)),
        open_model_file(spec["kind"], reference, inputs, threads),
        inputs,
        validation,
    )


def weights_digest(module) -> str:
    """A digest of a module's parameters and buffers, in name order: proof that the module a
    measuring process rebuilt is the one the search imported."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def torch_recipe(model) -> dict:
    """How a measuring process rebuilds ``model.torch_module`` from data alone, never from a
    pickle (which would run whatever it was sent): a zoo name, whose weights are seeded, or
    the user's ExportedProgram file. Raises where the model has neither."""
    if model.torch_recipe is None:
        raise RuntimeError("only zoo models and .pt2 files can be rebuilt without pickle")
    return model.torch_recipe | {"digest": weights_digest(model.torch_module)}


def rebuild_module(recipe: dict):
    """The module of a ``torch_recipe``, checked against the digest of the one searched."""
    if "zoo" in recipe:
        from partune.frontend import ZOO

        if recipe["zoo"] not in ZOO:
            raise RuntimeError(f"this device's partune has no zoo model {recipe['zoo']!r}")
        module = ZOO[recipe["zoo"]].build()
    elif "pt2" in recipe:
        module = load_program(base64.b64decode(recipe["pt2"])).module()
    else:
        raise RuntimeError("a torch peer with neither a zoo name nor an ExportedProgram")
    if weights_digest(module) != recipe.get("digest"):
        raise RuntimeError(
            "the rebuilt torch module's weights differ from the searched model's "
            "(a different partune or torch on the device?)"
        )
    return module
