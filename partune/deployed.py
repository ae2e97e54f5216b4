"""Load and run a deploy directory written by ``partune export``: no search code involved.

A deploy directory of a model-file plan (no partitioned plan beat a library on the
model's own ONNX graph) holds that graph, ``model.onnx``, run here by its library.
Otherwise it holds the compiled model (``model.so``: the Relax VM executable with
every TVM-native region compiled in), one file per library region (the region as TVM
JSON, rebuilt here by its backend: onnxruntime, OpenVINO or torch kernels live in
Python and are registered in this process under the symbols the executable calls),
``plan.json``, and ``manifest.json`` with checksums and the environment it was built in.
This module imports TVM, numpy, ``partune.core`` and ``partune.backends`` only: nothing of
the search, the store or the cost models (the import-linter contract holds it).

    model = partune.deployed.load("deploy/")
    outputs = model(x)          # numpy in, list of numpy out

A deployment of a plan with shape buckets (``partune tune --shapes``; written by
``partune.export_shapes``) loads as a ``ShapeDispatch``: every bucket (a deploy directory of its
own) and the user's own file. A call goes where ``ShapePlans.route`` sends it: the bucket tuned
at its shapes; the smallest bucket above them, its inputs padded with zeros up to the bucket's
point (on axes where that is safe: a mask's zeros hide the padding) and its outputs cut back;
else the user's file under the fallback library, which runs any shape. ``stats`` counts where
calls went, so a service learns which shapes it sends that no bucket serves.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from partune.backends import first_damaged
from partune.core import Route, SEScope, ShapePlans, deploy_environment

MANIFEST = "manifest.json"
FORMAT = 1


class DeployError(RuntimeError):
    """A deploy directory that is incomplete, modified, or built for another environment."""


@dataclass
class Deployed:
    """A loaded model: call it with numpy arrays, get a list of numpy arrays back.

    Either a Relax VM (a partitioned plan) or, for a model-file plan, the model's own ONNX
    graph under its library (``file_run``, a ``partune.backends.model_file.ModelFileRun``).
    """

    vm: object
    device: object
    manifest: dict
    path: Path
    file_run: object = None

    def example_inputs(self) -> list[np.ndarray]:
        """The inputs the model was exported with."""
        return _npz(self.path / "example_inputs.npz")

    def reference_outputs(self) -> list[np.ndarray]:
        """What the reference (torch eager, onnxruntime, ...) gave on the example inputs."""
        return _npz(self.path / "reference_outputs.npz")

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        if self.file_run is not None:
            return self.file_run(self._checked(inputs))
        return _flatten(self.vm["main"](*self.to_device(*inputs)))

    def prepare(self, *inputs: np.ndarray):
        """A no-argument call on these inputs, converted once (what ``partune run`` times)."""
        if self.file_run is not None:
            return self.file_run.prepare(self._checked(inputs))
        args, main = self.to_device(*inputs), self.vm["main"]
        return lambda: main(*args)

    def _checked(self, inputs) -> list[np.ndarray]:
        return _checked_inputs(self.manifest, inputs)

    def to_device(self, *inputs: np.ndarray) -> list:
        """Checked device tensors for ``vm["main"]``: convert once, call many times. On the CPU
        an input is shared with TVM through DLPack (copied only to reach TVM's 64-byte
        alignment): ``tvm.runtime.tensor`` copied through a slow path, 85 us an input of 32
        ints, more than a small model's whole run."""
        import tvm

        if self.device.dlpack_device_type() != tvm.cpu().dlpack_device_type():
            return [tvm.runtime.tensor(a, self.device) for a in self._checked(inputs)]
        return [tvm.runtime.from_dlpack(_aligned(a)) for a in self._checked(inputs)]


def _checked_inputs(manifest: dict, inputs) -> list[np.ndarray]:
    """``inputs`` as contiguous arrays, once they match the manifest's inputs: their number,
    each one's dtype, and its shape where the manifest lists one (a deployment with shape
    buckets lists none)."""
    want = manifest["inputs"]
    if len(inputs) != len(want):
        raise DeployError(f"{manifest['model']} takes {len(want)} inputs, got {len(inputs)}")
    out = []
    for a, spec in zip(inputs, want, strict=True):
        a = np.ascontiguousarray(a)
        shape = spec.get("shape")
        if (shape is not None and list(a.shape) != shape) or str(a.dtype) != spec["dtype"]:
            got = f"{a.dtype}{list(a.shape)}" if shape is not None else str(a.dtype)
            raise DeployError(
                f"input '{spec['name']}' must be {spec['dtype']}{shape or ''}, got {got}"
            )
        out.append(a)
    return out


def _npz(path: Path) -> list[np.ndarray]:
    """Arrays saved by ``np.savez(path, *arrays)``, in their order (arr_0, arr_1, ...)."""
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _aligned(a: np.ndarray, to: int = 64) -> np.ndarray:
    """``a`` where TVM takes it without a copy: C-contiguous at a ``to``-byte boundary (a copy
    into such a buffer where it is not)."""
    if a.flags.c_contiguous and a.ctypes.data % to == 0:
        return a
    buf = np.empty(a.nbytes + to, np.uint8)
    start = -buf.ctypes.data % to
    out = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _flatten(out) -> list[np.ndarray]:
    """The VM's outputs as numpy arrays, sharing the VM's buffers (DLPack: the array keeps its
    tensor alive, so no later call reuses the memory); ``.numpy()`` copied each one."""
    if hasattr(out, "__dlpack__"):
        return [np.from_dlpack(out)]
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for o in out for a in _flatten(o)]


def verify(path: Path) -> dict:
    """The manifest, once every file checks out and this environment matches the export's."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DeployError(f"{path} is not a deploy directory (no {MANIFEST}; see `partune export`)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise DeployError(f"{mpath} is corrupt: {e}") from e
    if manifest.get("format") != FORMAT:
        raise DeployError(
            f"{path}: deploy format {manifest.get('format')}, this Partune reads {FORMAT}"
        )
    damaged = first_damaged(path, manifest["files"])
    if damaged:
        raise DeployError(f"{path}: {damaged}")
    here = deploy_environment(manifest["backends"])
    diff = [
        f"{k} {v} (exported with {manifest['environment'].get(k)})"
        for k, v in here.items()
        if manifest["environment"].get(k) != v
    ]
    if diff:
        raise DeployError(
            f"{path} was exported for another environment: this one has " + ", ".join(diff)
        )
    return manifest


def load(path: str | Path, threads: int | None = None):
    """Verify a deploy directory, register its library regions, load the compiled model (a
    ``Deployed``; a ``ShapeDispatch`` where the plan has shape buckets, each loaded so)."""
    import tvm
    from tvm import relax

    from partune.backends import registry

    path = Path(path)
    manifest = verify(path)
    registry.set_threads(threads or manifest["threads"])
    if "buckets" in manifest:
        return _load_buckets(path, manifest, threads)
    if file := manifest.get("model_file"):
        from partune.backends import ModelFileError, open_model_file

        examples = [np.zeros(i["shape"], i["dtype"]) for i in manifest["inputs"]]
        try:
            run = open_model_file(
                file["library"],
                (path / file["file"]).read_bytes(),
                examples,
                registry.threads(),
                file.get("precision", "f32"),  # OpenVINO's bf16 hint, where the plan had it
            )
        except ModelFileError as e:
            raise DeployError(f"{path}: {e}") from e
        return Deployed(None, None, manifest, path, file_run=run)
    for region in manifest["regions"]:
        func = tvm.ir.load_json((path / region["file"]).read_text())["region"]
        scope = SEScope(
            region["device_type"],
            region["virtual_device_id"],
            backend=region["backend"],
            precision=region.get("precision"),
            threads=region.get("threads"),
        )
        kernel = registry.get(region["backend"]).build_region(func, scope, registry.threads())
        tvm.register_global_func(region["symbol"], kernel, override=True)
    lib = tvm.runtime.load_module(str(path / manifest["library"]))
    device = tvm.device(manifest["device_type"], 0)
    return Deployed(relax.VirtualMachine(lib, device), device, manifest, path)


# A deployment with shape buckets (``partune.export_shapes``): each call runs the plan tuned for
# its shapes (``ShapePlans.route``).


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
        return _checked_inputs(self.manifest, inputs)  # no shapes listed: they are the router's

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


def _load_buckets(path: Path, manifest: dict, threads: int | None) -> ShapeDispatch:
    """The deployment at ``path`` (its manifest verified): every bucket loaded (``load``), and
    the user's file under the fallback library."""
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
