"""Relax op -> ATen translation: ``translate_call`` for one call and ``check_binding``
for ``accepts``.

The translators themselves live in families (element-wise, nn, reductions, shapes) that
register into ``OPS`` with ``@op``; this module imports them all, so ``OPS`` is complete
wherever ``translate_call`` is used. Separate from the fuser and the program, which build
on single-binding translation.
"""

from __future__ import annotations

from typing import Any

import torch
import tvm
from tvm import relax

from partune.backends import (
    torch_elementwise_ops,
    torch_nn_ops,
    torch_reduction_ops,
    torch_shape_ops,
)
from partune.backends.torch_op_registry import (
    OPS,
    GenericConst,
    OpCall,
    OpFn,
    Unsupported,
    check_type,
    is_dynamic,
)

TRANSLATOR_FAMILIES = (torch_elementwise_ops, torch_nn_ops, torch_reduction_ops, torch_shape_ops)
"""Imported for their ``@op`` registrations into ``OPS``."""


# --------------------------------------------------------------------------- translation


def translate_call(call: relax.Call, out_ty: Any, device: torch.device) -> OpFn:
    """The ATen closure for one Relax call, or Unsupported."""
    if not isinstance(call.op, tvm.ir.Op):
        raise Unsupported("call to a non-operator")
    tr = OPS.get(call.op.name)
    if tr is None:
        raise Unsupported(f"op {call.op.name} has no translator")
    check_type(out_ty)
    for a in call.args:
        if is_dynamic(a):
            check_type(a.ty)
    return tr(OpCall(call, out_ty, device))


def check_binding(binding: Any) -> None:
    """Raise Unsupported unless ``binding`` translates (without touching constant data)."""
    if not isinstance(binding, relax.VarBinding):
        raise Unsupported(f"{type(binding).__name__} bindings are not supported")
    value, ty = binding.value, binding.var.ty
    if isinstance(value, relax.Call):
        translate_call(value, ty, torch.device("cpu"))
    elif isinstance(value, (relax.Var, GenericConst, relax.TupleGetItem)):
        check_type(ty)
    elif isinstance(value, relax.Tuple):
        for f in value.fields:
            if not is_dynamic(f):
                raise Unsupported("tuple of non-tensors")
        check_type(ty)
    else:
        raise Unsupported(f"binding value {type(value).__name__}")
