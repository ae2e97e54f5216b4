"""A deployment with shape buckets: each call runs the plan tuned for its shapes.

``partune.deployed.load`` returns a ``ShapeDispatch`` for a directory that
``partune.export_shapes`` wrote. A call goes where ``ShapePlans.route`` sends it: the bucket
tuned at its shapes; the smallest bucket above them, its inputs padded with zeros up to the
bucket's point (on axes where that is safe: a mask's zeros hide the padding) and its outputs
cut back; else the user's own file under the fallback library, which runs any shape. ``stats``
counts where calls went, so a service learns which shapes it sends that no bucket serves.
Imports what ``partune.deployed`` does, nothing of the search.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from partune.core import Route, ShapePlans
from partune.deployed import Deployed, DeployError


def _pad(a: np.ndarray, dims: dict[int, int]) -> np.ndarray:
    """``a`` with zeros after its end on each of ``dims`` (axis -> the size to reach)."""
    widths = [(0, dims.get(d, n) - n) for d, n in enumerate(a.shape)]
    return np.pad(a, widths) if any(w for _, w in widths) else a


def _cut(a: np.ndarray, dims: dict[int, int]) -> np.ndarray:
    """``a`` cut back to ``dims`` (axis -> the call's size) where it was padded."""
    index = tuple(slice(0, dims[d]) if d in dims else slice(None) for d in range(a.ndim))
    return np.ascontiguousarray(a[index])


@dataclass
class ShapeDispatch:
    """Call it with numpy arrays of any shape the model file allows; get a list of arrays."""

    plans: ShapePlans
    buckets: list[Deployed]
    fallback: object  # a ``partune.backends.model_file.ModelFileRun`` on the user's file
    manifest: dict
    path: Path
    stats: Counter = field(default_factory=Counter)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        inputs = self._checked(inputs)
        route = self.plans.route([a.shape for a in inputs])
        if route.bucket is None:
            self.stats["fallback"] += 1
            return self.fallback(list(inputs))
        self.stats[f"bucket{route.bucket}"] += 1
        if not route.padded:
            return self.buckets[route.bucket](*inputs)
        self.stats["padded"] += 1
        return self._padded(route, inputs)

    def prepare(self, *inputs: np.ndarray):
        """A no-argument call on these inputs (what ``partune run`` times): the bucket's own
        where the shapes are its point, else the whole dispatch."""
        inputs = self._checked(inputs)
        route = self.plans.route([a.shape for a in inputs])
        if route.bucket is not None and not route.padded:
            return self.buckets[route.bucket].prepare(*inputs)
        return lambda: self(*inputs)

    def _padded(self, route: Route, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """A call padded up to its bucket's point on each padded axis, its outputs cut back."""
        grow: dict[int, dict[int, int]] = {}
        for axis, (_, point) in route.padded.items():
            for use in self.plans.axes[axis]:
                grow.setdefault(use.index, {})[use.dim] = point
        outputs = self.buckets[route.bucket](
            *[_pad(a, grow.get(i, {})) for i, a in enumerate(inputs)]
        )
        cut: dict[int, dict[int, int]] = {}
        for axis, (value, _) in route.padded.items():
            for use in self.plans.outputs.get(axis, ()):
                cut.setdefault(use.index, {})[use.dim] = value
        return [_cut(y, cut.get(i, {})) for i, y in enumerate(outputs)]

    def _checked(self, inputs) -> list[np.ndarray]:
        """``inputs`` as arrays, once their number and dtypes match the model's (shapes are
        the router's)."""
        want = self.manifest["inputs"]
        if len(inputs) != len(want):
            raise DeployError(
                f"{self.manifest['model']} takes {len(want)} inputs, got {len(inputs)}"
            )
        out = []
        for a, spec in zip(inputs, want, strict=True):
            a = np.ascontiguousarray(a)
            if str(a.dtype) != spec["dtype"]:
                raise DeployError(f"input '{spec['name']}' must be {spec['dtype']}, got {a.dtype}")
            out.append(a)
        return out

    def describe(self) -> str:
        """One line per bucket: its point and the shapes it serves; then the fallback."""
        lines = []
        for i, served in enumerate(self.plans.ranges()):
            span = ", ".join(
                f"{a} {lo}-{hi}" if lo < hi else f"{a} {hi}" for a, (lo, hi) in served.items()
            )
            lines.append(f"bucket{i}: {span}")
        lines.append(f"any other shape: the model file under {self.plans.fallback}")
        return "\n".join(lines)


def load_buckets(path: Path, manifest: dict, threads: int | None, load) -> ShapeDispatch:
    """The deployment at ``path`` (its manifest verified): every bucket loaded with ``load``
    (``partune.deployed.load``), and the user's file under the fallback library."""
    from partune.backends import ModelFileError, open_model_file, registry

    buckets = [load(path / name, threads) for name in manifest["buckets"]]
    file = manifest["fallback"]
    try:
        fallback = open_model_file(
            file["library"], (path / file["file"]).read_bytes(), None, registry.threads()
        )
    except ModelFileError as e:
        raise DeployError(f"{path}: {e}") from e
    return ShapeDispatch(
        ShapePlans.from_json(manifest["shapes"]), buckets, fallback, manifest, path
    )
