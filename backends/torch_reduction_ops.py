"""Translators for the Relax reductions: mean, sum, prod, max, min and cumsum.

One family of the op translators (see ``torch_ops``), kept apart from the element-wise,
nn and shape families so each module stays about one kind of op.
"""

from __future__ import annotations

import torch

from partune.backends.torch_op_registry import (
    FLOATS,
    NUMERIC,
    OpCall,
    OpFn,
    identity,
    norm_axis,
    op,
)

# --------------------------------------------------------------------------- reductions


def reduce_dims(o: OpCall) -> tuple[tuple[int, ...], bool]:
    nd = len(o.arg(0)[0])
    axis = o.attrs.axis
    dims = tuple(range(nd)) if axis is None else tuple(norm_axis(int(a), nd) for a in axis)
    o.need(len(dims) > 0 or nd == 0, "empty axis list")
    return dims, bool(o.attrs.keepdims)


@op("relax.mean")
def tr_mean(o: OpCall) -> OpFn:
    o.dtypes_in(FLOATS)
    dims, keep = reduce_dims(o)
    return (lambda x: torch.mean(x, dim=dims, keepdim=keep)) if dims else identity


@op("relax.sum", "relax.prod")
def tr_sum(o: OpCall) -> OpFn:
    """Relax keeps the input dtype (torch would widen integers to int64)."""
    o.dtypes_in(NUMERIC)
    dims, keep = reduce_dims(o)
    dt = o.out_dtype
    if o.call.op.name == "relax.sum":
        return (lambda x: torch.sum(x, dim=dims, keepdim=keep, dtype=dt)) if dims else identity

    def prod(x: torch.Tensor) -> torch.Tensor:
        for d in sorted(dims, reverse=True):
            x = torch.prod(x, dim=d, keepdim=keep, dtype=dt)
        return x

    return prod


@op("relax.max", "relax.min")
def tr_max(o: OpCall) -> OpFn:
    o.dtypes_in(NUMERIC | {"bool"})
    dims, keep = reduce_dims(o)
    fn = torch.amax if o.call.op.name == "relax.max" else torch.amin
    return (lambda x: fn(x, dim=dims, keepdim=keep)) if dims else identity


@op("relax.cumsum")
def tr_cumsum(o: OpCall) -> OpFn:
    """Accumulates in the result dtype; a bool result (importers emit it) means 'any so far'."""
    shape, _ = o.arg(0)
    axis = o.attrs.axis
    flat = axis is None
    dim = 0 if flat else norm_axis(int(axis), len(shape))
    out = o.out_dtype
    acc = torch.int64 if out == torch.bool else out
    exclusive = bool(o.attrs.exclusive)

    def cumsum(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1) if flat else x
        y = torch.cumsum(x, dim, dtype=acc)
        if exclusive:
            y = y - x.to(acc)
        return y.to(out)

    return cumsum
