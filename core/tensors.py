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


def known_shape(ty) -> tuple[int, ...] | None:
    """The shape of a tensor type, or None where it is not a tensor or a dimension is unknown."""
    from tvm import relax

    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    try:
        return static_shape(ty)
    except TypeError:  # a symbolic dimension
        return None
