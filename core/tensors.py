"""Tensor types of Relax values: a region's flat inputs and outputs."""

from __future__ import annotations


def tensor_types(ty) -> list:
    """The tensor types in ``ty``, tuples flattened in order (a region's flat inputs/outputs)."""
    from tvm import relax

    if isinstance(ty, relax.TensorType):
        return [ty]
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in tensor_types(f)]
    return []


def static_shape(ty) -> tuple[int, ...]:
    """The shape of a tensor type whose dimensions are all known."""
    return tuple(int(v) for v in ty.shape.values)
