"""Tensors: the types of Relax values (a region's flat inputs and outputs), the random
inputs every measurement feeds, and any framework's outputs as numpy arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def random_array(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random data of a dtype: normal floats; 0/1 integers and bools, valid as any index."""
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def draw_like(inputs: Sequence[np.ndarray], seed: int) -> list[np.ndarray]:
    """Another input set drawn like ``inputs``, so that data the user did not give still looks
    like the model's: floats with each input's mean and spread, integers (token ids, indices)
    within each input's range, booleans at random. Seeded: the same set for the same seed."""
    rng = np.random.default_rng(seed)
    out = []
    for a in inputs:
        if a.dtype == bool:
            out.append(rng.integers(0, 2, size=a.shape).astype(bool))
        elif np.issubdtype(a.dtype, np.integer):
            lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
            out.append(rng.integers(lo, hi + 1, size=a.shape).astype(a.dtype))
        else:
            mean, std = (float(a.mean()), float(a.std())) if a.size else (0.0, 1.0)
            out.append((mean + (std or 1.0) * rng.standard_normal(a.shape)).astype(a.dtype))
    return out


def flatten_outputs(out) -> list[np.ndarray]:
    """Outputs of the TVM VM, torch or onnxruntime as a flat list of numpy arrays."""
    if isinstance(out, np.ndarray):
        return [out]
    if hasattr(out, "detach"):  # torch
        return [out.detach().cpu().numpy()]
    if hasattr(out, "numpy"):  # TVM tensor
        return [out.numpy()]
    if isinstance(out, dict):
        out = list(out.values())
    return [a for o in out for a in flatten_outputs(o)]
