"""The shapes a job tunes at: a model file's symbolic axes, ``--shapes``, and the defaults.

An ONNX export names its open dimensions (``batch``, ``sequence``): each name is an *axis*,
shared by every input and output that uses it. ``--shapes "sequence=32,128,384;batch=1,8"``
gives the points to tune each axis at (every combination is a point, one plan each:
``partune.core.shapes``), or ``NAME=D1,D2,...`` one input's whole shape, as ``--input-shape``
does. An axis given no points takes its default: 128 for a sequence (a sequence of one token
measures nothing a served model does), 1 for a batch and for anything else, and the job says
so. Padding a call up to a bucket's point is safe on a sequence axis that an attention-mask
input carries (the mask's zeros hide the padding), and on any axis the user declares safe.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from partune.core import AxisUse, ModelError, point_label

SEQUENCE_DEFAULT = 128
_SEQUENCE = re.compile(r"seq|token|len", re.IGNORECASE)
_MASK = re.compile(r"mask", re.IGNORECASE)

Dims = tuple[int | str, ...]  # a static size, or the name of an axis ("?": unnamed)


def is_sequence(axis: str) -> bool:
    """Whether an axis name says sequence (sequence, seq_len, num_tokens, length...)."""
    return bool(_SEQUENCE.search(axis))


def axis_default(axis: str) -> int:
    """The value an axis is tuned at when no one says: 128 for a sequence, else 1."""
    return SEQUENCE_DEFAULT if is_sequence(axis) else 1


@dataclass(frozen=True)
class FileShapes:
    """A model file's inputs and outputs, each a name and its dimensions."""

    inputs: tuple[tuple[str, Dims], ...]
    outputs: tuple[tuple[str, Dims], ...] = ()

    def axes(self) -> dict[str, tuple[AxisUse, ...]]:
        """Each named axis, where the inputs use it."""
        return _axis_uses(self.inputs)

    def output_axes(self) -> dict[str, tuple[AxisUse, ...]]:
        """Each named axis, where the outputs use it (to cut padding off them)."""
        return _axis_uses(self.outputs)


def _axis_uses(entries: tuple[tuple[str, Dims], ...]) -> dict[str, tuple[AxisUse, ...]]:
    found: dict[str, list[AxisUse]] = {}
    for i, (_, dims) in enumerate(entries):
        for d, size in enumerate(dims):
            if isinstance(size, str) and size != "?":
                found.setdefault(size, []).append(AxisUse(i, d))
    return {a: tuple(uses) for a, uses in found.items()}


def _dims(value_info) -> Dims:
    return tuple(
        d.dim_value if d.dim_value > 0 else (d.dim_param or "?")
        for d in value_info.type.tensor_type.shape.dim
    )


def file_shapes(proto) -> FileShapes:
    """The dimensions an ONNX model declares for its inputs (weights aside) and outputs."""
    weights = {i.name for i in proto.graph.initializer}
    return FileShapes(
        tuple((i.name, _dims(i)) for i in proto.graph.input if i.name not in weights),
        tuple((o.name, _dims(o)) for o in proto.graph.output),
    )


def read_file_shapes(path: str | Path) -> FileShapes:
    """``file_shapes`` of the ONNX file at ``path`` (its weights left unread)."""
    import onnx

    try:
        return file_shapes(onnx.load(str(path), load_external_data=False))
    except Exception as e:  # noqa: BLE001 - protobuf and onnx raise many kinds
        raise ModelError(f"cannot read ONNX model {path}: {str(e).strip()[:200]}") from e


@dataclass(frozen=True)
class ShapePoint:
    """One point a job tunes at: each axis's value, and each input's static shape there."""

    values: dict[str, int]
    shapes: dict[str, tuple[int, ...]]

    @property
    def label(self) -> str:
        """``batch=1,sequence=128``: how summaries and study names call it."""
        return point_label(self.values)


def _sizes(text: str, entry: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ModelError(f"--shapes {entry}: sizes must be whole numbers of at least 1")
    return sizes


def _parse(text: str, fs: FileShapes) -> tuple[dict[str, tuple[int, ...]], dict]:
    """``--shapes`` as (axis -> points, input -> whole shape), each entry checked against
    the file."""
    axes, names = fs.axes(), dict(fs.inputs)
    points: dict[str, tuple[int, ...]] = {}
    whole: dict[str, tuple[int, ...]] = {}
    for entry in (e.strip() for e in text.split(";") if e.strip()):
        key, eq, rest = entry.partition("=")
        key = key.strip()
        if not eq or key not in (*axes, *names):
            raise ModelError(
                f"--shapes {entry}: names no input or axis of the model (inputs: "
                f"{', '.join(names)}; axes: {', '.join(axes) or 'none'})"
            )
        sizes = _sizes(rest, entry)
        if key in axes:
            points[key] = tuple(dict.fromkeys(sizes))
            continue
        dims = names[key]
        if len(sizes) != len(dims) or any(
            isinstance(d, int) and d != s for d, s in zip(dims, sizes, strict=True)
        ):
            raise ModelError(f"--shapes {entry}: does not fit {key}'s declared shape {list(dims)}")
        whole[key] = sizes
    return points, whole


def tuning_points(fs: FileShapes, text: str | None) -> list[ShapePoint]:
    """The points a job tunes at: every combination of the axes' points (``--shapes``), each
    axis no entry names at its default. Raises a one-line ModelError on an entry naming no
    input or axis, or a shape that does not fit a static dimension."""
    points, whole = _parse(text or "", fs)
    fixed: dict[str, int] = {}
    for name, sizes in whole.items():
        for d, size in zip(dict(fs.inputs)[name], sizes, strict=True):
            if isinstance(d, str) and d != "?":
                if points.get(d, (size,)) != (size,) or fixed.get(d, size) != size:
                    raise ModelError(f"--shapes gives axis {d} two sizes ({name}={size})")
                fixed[d] = size
    grid = {a: points.get(a, (fixed.get(a, axis_default(a)),)) for a in fs.axes()}
    out = []
    for combo in itertools.product(*grid.values()):
        values = dict(zip(grid, combo, strict=True))
        shapes = {
            name: whole.get(name)
            or tuple(d if isinstance(d, int) else values.get(d, 1) for d in dims)
            for name, dims in fs.inputs
        }
        out.append(ShapePoint(values, shapes))
    return out


def pad_safe(fs: FileShapes, declared: tuple[str, ...] = ()) -> dict[str, str]:
    """The axes a call may be padded on, each with why: declared by the user, or a sequence
    axis an attention-mask input carries. Raises on a declared name that is no axis."""
    axes = fs.axes()
    if unknown := [a for a in declared if a not in axes]:
        raise ModelError(
            f"--pad-safe {', '.join(unknown)}: no such axis (axes: {', '.join(axes) or 'none'})"
        )
    safe = {a: "declared" for a in declared}
    for axis, uses in axes.items():
        masks = [fs.inputs[u.index][0] for u in uses if _MASK.search(fs.inputs[u.index][0])]
        if axis not in safe and is_sequence(axis) and masks:
            safe[axis] = f"mask {masks[0]}"
    return safe
