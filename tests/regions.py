"""Shared by the backend tests: the small zoo as raw Relax, and calling a built region."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import tvm
from tvm import relax

from partune.core.tensors import tensor_types

SMALL_ZOO = [
    "resnet50-small",
    "mobilenet_v2-small",
    "convnext-small",
    "vit-small",
    "bert-small",
    "gpt2-small",
]

_zoo: dict[str, tuple[relax.Function, tuple[torch.Tensor, ...], np.ndarray]] = {}


def zoo_mains() -> dict[str, tuple[relax.Function, tuple[torch.Tensor, ...], np.ndarray]]:
    """Each small zoo model imported once per session, as the torch frontend gives it
    (not normalised, so backends see what importers emit): (main, inputs, eager output)."""
    from tvm.relax.frontend.torch import from_exported_program

    from partune.frontend.zoo import ZOO

    for name in SMALL_ZOO:
        if name not in _zoo:
            entry = ZOO[name]
            model, inputs = entry.build(), entry.inputs()
            with torch.no_grad():
                ref = model(*inputs)
            mod = from_exported_program(torch.export.export(model, inputs))
            _zoo[name] = (mod["main"], inputs, ref.numpy())
    return _zoo


def empty(ty: relax.TensorType) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.zeros([int(d) for d in ty.shape.values], str(ty.dtype)))


def run_region(backend, scope, func: relax.Function, *inputs: np.ndarray) -> list[np.ndarray]:
    """Build ``func`` on ``backend`` and call it destination-passing style; the outputs."""
    kernel = backend.build_region(func, scope, 1)
    outs = [empty(t) for t in tensor_types(func.ret_ty)]
    kernel(*(tvm.runtime.tensor(np.asarray(x).copy()) for x in inputs), *outs)
    return [o.numpy() for o in outs]


def one_op(
    params: list[tuple[tuple[int, ...], str]], body: Callable[..., relax.Expr]
) -> relax.Function:
    """A one-op Relax function (tuple results are unpacked into a tuple of vars)."""
    bb = relax.BlockBuilder()
    args = [relax.Var(f"p{i}", relax.TensorType(s, d)) for i, (s, d) in enumerate(params)]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit(body(*args))
            if isinstance(out.ty, relax.TupleType):
                out = bb.emit(
                    relax.Tuple(
                        [bb.emit(relax.TupleGetItem(out, i)) for i in range(len(out.ty.fields))]
                    )
                )
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()["main"]


def first_binding(func: relax.Function) -> relax.Binding:
    return func.body.blocks[0].bindings[0]
