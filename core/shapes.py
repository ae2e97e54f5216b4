"""The shapes a plan serves: one plan per shape bucket, and the bucket a call's shapes go to.

A model file with symbolic axes (batch, sequence) runs any shape in its own library, but a
plan is partitioned, built and measured at static shapes. So a job tuned at several points
(``--shapes "sequence=32,128,384"``) keeps one plan per point, a *bucket*, and
``ShapePlans.route`` sends each call:

- to the bucket tuned at exactly its shapes;
- else to the smallest bucket above them, padded up to its point, on axes where padding is
  known to be safe: an attention mask that zeroes the padded positions, or the user's word;
  the outputs are cut back on the same axes;
- else (a shape above every point, or padding not known safe) to the user's own file under
  its fastest library (``fallback``), which runs any shape.

Each axis is read off the inputs where the file names it (``AxisUse``); the points of one
axis split its values into ranges: the bucket tuned at ``p`` serves the values above the next
smaller point up to ``p``. Kept in the plan file (format ``FORMAT``) and the deploy manifest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partune.core.errors import PlanError
from partune.core.plan import SHAPES_FORMAT as FORMAT
from partune.core.plan import Plan, read_plan_json

# The library for the shapes no bucket serves where no verdict timed one on the user's file.
DEFAULT_FALLBACK = "onnxruntime"


@dataclass(frozen=True)
class AxisUse:
    """Where a symbolic axis sits: dimension ``dim`` of input (or output) number ``index``."""

    index: int
    dim: int

    def to_json(self) -> list[int]:
        return [self.index, self.dim]


def point_label(values: dict[str, int]) -> str:
    """A point as summaries and study names call it: ``batch=1,sequence=128``."""
    return ",".join(f"{a}={v}" for a, v in values.items())


@dataclass(frozen=True)
class ShapeBucket:
    """A plan tuned at one point: ``point`` gives each axis's value, ``inputs`` each input's
    static shape there (what the plan's model was imported with)."""

    point: dict[str, int]
    inputs: tuple[tuple[int, ...], ...]
    plan: Plan

    def to_json(self) -> dict[str, Any]:
        return {
            "point": self.point,
            "inputs": [list(s) for s in self.inputs],
            "plan": self.plan.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapeBucket:
        return cls(
            {str(k): int(v) for k, v in data["point"].items()},
            tuple(tuple(int(d) for d in s) for s in data["inputs"]),
            Plan.from_json(data["plan"]),
        )


@dataclass(frozen=True)
class Route:
    """Where one call goes: ``bucket`` (an index; None: the fallback, the user's file) and, for
    each padded axis, ``(the call's value, the bucket's)``."""

    bucket: int | None
    padded: dict[str, tuple[int, int]] = field(default_factory=dict)


def _uses(data: dict[str, Any]) -> dict[str, tuple[AxisUse, ...]]:
    return {str(a): tuple(AxisUse(int(i), int(d)) for i, d in uses) for a, uses in data.items()}


@dataclass(frozen=True)
class ShapePlans:
    """One plan per tuned point of the model's symbolic axes, and how calls find theirs.

    ``axes``/``outputs``: where each axis sits in the inputs and outputs; ``pad``: the axes
    padding is safe on, each with why ("mask attention_mask", "declared"); ``fallback``: the
    library that runs the user's file for the shapes no bucket serves."""

    axes: dict[str, tuple[AxisUse, ...]]
    buckets: tuple[ShapeBucket, ...]
    outputs: dict[str, tuple[AxisUse, ...]] = field(default_factory=dict)
    pad: dict[str, str] = field(default_factory=dict)
    fallback: str = DEFAULT_FALLBACK

    def values(self, shapes: list[tuple[int, ...]]) -> dict[str, int] | None:
        """Each axis's value in a call's ``shapes``; None where two inputs disagree on one."""
        out: dict[str, int] = {}
        for axis, uses in self.axes.items():
            seen = {shapes[u.index][u.dim] for u in uses if u.dim < len(shapes[u.index])}
            if len(seen) != 1:
                return None
            out[axis] = seen.pop()
        return out

    def route(self, shapes: list[tuple[int, ...]]) -> Route:
        """The bucket for a call: its own point, else the one needing the least padding (by the
        volume of its point) among those above it on every axis, padding only safe axes; else
        the fallback."""
        values = self.values(shapes)
        if values is None:
            return Route(None)
        best: tuple[float, int] | None = None
        for i, bucket in enumerate(self.buckets):
            if self._static_differ(bucket, shapes):
                continue
            gaps = {a: values[a] for a in self.axes if bucket.point[a] != values[a]}
            if any(v > bucket.point[a] or a not in self.pad for a, v in gaps.items()):
                continue
            volume = math.prod(bucket.point.values())
            if best is None or volume < best[0]:
                best = (volume, i)
        if best is None:
            return Route(None)
        point = self.buckets[best[1]].point
        return Route(
            best[1], {a: (values[a], point[a]) for a in self.axes if point[a] != values[a]}
        )

    def _static_differ(self, bucket: ShapeBucket, shapes: list[tuple[int, ...]]) -> bool:
        """Whether a call's shapes differ from ``bucket``'s in rank or a dimension no axis
        names (no padding mends that)."""
        named = {(u.index, u.dim) for uses in self.axes.values() for u in uses}
        if len(shapes) != len(bucket.inputs):
            return True
        return any(
            len(s) != len(b) or any(s[d] != b[d] for d in range(len(b)) if (i, d) not in named)
            for i, (s, b) in enumerate(zip(shapes, bucket.inputs, strict=True))
        )

    def ranges(self) -> list[dict[str, tuple[int, int]]]:
        """Per bucket, the values of each axis it serves at its own point's neighbours: above
        the next smaller point of that axis (1 below the first) up to its own."""
        points = {a: sorted({b.point[a] for b in self.buckets}) for a in self.axes}
        out = []
        for b in self.buckets:
            served = {}
            for a, p in b.point.items():
                below = [q for q in points[a] if q < p]
                served[a] = (p if a not in self.pad else below[-1] + 1 if below else 1, p)
            out.append(served)
        return out

    def spans(self) -> list[str]:
        """``ranges`` as people read them, one line per bucket ("batch 1, sequence 33-128")."""
        return [
            ", ".join(f"{a} {lo}-{hi}" if lo < hi else f"{a} {hi}" for a, (lo, hi) in r.items())
            for r in self.ranges()
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "axes": {a: [u.to_json() for u in uses] for a, uses in self.axes.items()},
            "outputs": {a: [u.to_json() for u in uses] for a, uses in self.outputs.items()},
            "pad": self.pad,
            "fallback": self.fallback,
            "buckets": [b.to_json() for b in self.buckets],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapePlans:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"not a Partune plan with shape buckets (expected format '{FORMAT}')")
        try:
            return cls(
                _uses(data["axes"]),
                tuple(ShapeBucket.from_json(b) for b in data["buckets"]),
                _uses(data.get("outputs", {})),
                {str(k): str(v) for k, v in data.get("pad", {}).items()},
                str(data.get("fallback") or DEFAULT_FALLBACK),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed plan with shape buckets: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_plans(path: str | Path) -> Plan | ShapePlans:
    """A plan file: one ``Plan``, or a ``ShapePlans`` where the job tuned several shapes."""
    data = read_plan_json(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return ShapePlans.from_json(data)
    return Plan.from_json(data)
