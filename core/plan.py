"""Plan: which SEScope runs which nodes of a model. JSON, no pickle.

A plan is the product of the search and the input of deployment, so it must survive
being written, read back, and checked against the model it is applied to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partune.core.errors import PlanError
from partune.core.graph import DataflowGraph
from partune.core.scopes import CompilationConfig, ScopeError, SEScope
from partune.core.versions import tool_versions

FORMAT = "partune-plan/1"
SHAPES_FORMAT = "partune-shapes/1"  # a plan per shape bucket (``partune.core.shapes``)


@dataclass(frozen=True)
class Region:
    """Node indices offloaded together to one SEScope, with the measured cost if known."""

    nodes: tuple[int, ...]
    scope: SEScope
    cost_s: float | None = None

    @property
    def backend(self) -> str:
        assert self.scope.backend is not None
        return self.scope.backend

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nodes": list(self.nodes), "scope": self.scope.to_json()}
        if self.cost_s is not None:
            out["cost_s"] = self.cost_s
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Region:
        return cls(
            tuple(int(i) for i in data["nodes"]),
            SEScope.from_json(data["scope"]),
            data.get("cost_s"),
        )


@dataclass(frozen=True)
class ModelFile:
    """The plan that runs the model's own ONNX graph whole under one library, unpartitioned.

    It is what the search emits when no partitioned plan beats that library on the user's
    file: a plan is then never slower than the best library peer. ``origin`` says which
    graph ("your .onnx file", "torch.onnx.export", ...); ``sha256`` names the user's file,
    so the plan refuses to run another one (None for an export, made again where needed).

    A peer in reduced precision within the accuracy budget can be that plan too: ``precision``
    "bf16" is OpenVINO's inference-precision hint on the file; ``quantizer`` names the int8
    peer whose tool quantized it (``partune.runners.int8_peers``). A quantized file is data
    made from the model's file, so the plan keeps the recipe, not the bytes: the tool and its
    version (``quantized_with``), the ``metric`` and ``tolerance`` it was held to, and a
    digest of the samples (``quantized_on``); the export quantizes again (the tools are
    deterministic) and refuses where any of them differs.
    """

    library: str
    origin: str
    sha256: str | None = None
    precision: str = "f32"
    quantizer: str | None = None
    quantized_with: str | None = None
    quantized_on: str | None = None
    metric: str = "rel"
    tolerance: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"library": self.library, "origin": self.origin, "sha256": self.sha256}
        if self.precision != "f32":
            out["precision"] = self.precision
        if self.quantizer is not None:
            out |= {
                "quantizer": self.quantizer,
                "quantized_with": self.quantized_with,
                "quantized_on": self.quantized_on,
                "metric": self.metric,
                "tolerance": self.tolerance,
            }
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelFile:
        tolerance = data.get("tolerance")
        return cls(
            str(data["library"]),
            str(data["origin"]),
            data.get("sha256"),
            str(data.get("precision", "f32")),
            data.get("quantizer"),
            data.get("quantized_with"),
            data.get("quantized_on"),
            str(data.get("metric", "rel")),
            float(tolerance) if tolerance is not None else None,
        )

    def describe(self) -> str:
        """The plan in words: which graph, made how, under which library."""
        made = (
            f", quantized as the {self.quantizer} peer does it ({self.quantized_with}),"
            if self.quantizer is not None
            else ""
        )
        hint = f" with its {self.precision} hint" if self.precision != "f32" else ""
        return f"the model's own ONNX graph ({self.origin}){made} under {self.library}{hint}"

    @property
    def compute_precision(self) -> str:
        """What the file computes in: int8 where it was quantized, else ``precision``."""
        return "int8" if self.quantizer is not None else self.precision


@dataclass(frozen=True)
class Calibration:
    """How an int8 plan quantizes, measured once per model and data
    (``partune.search.int8_calibration``): the ranges of its activations, per tensor of ``main``
    (``n<i>`` a binding's value, ``p<i>`` a parameter), named by ``digest`` (the data and the
    model they were measured on). ``f32_units``: the matmuls and convolutions (node indices) left
    in f32 inside the plan's int8 regions, where a plan over its accuracy budget handed them
    back (``partune.search.precision``). Plans that differ in either compute different values
    (plan keys tell them apart), though they may take the same time."""

    digest: str
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict, compare=False)
    f32_units: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"digest": self.digest}
        out["ranges"] = {k: list(v) for k, v in self.ranges.items()}
        return out | ({"f32_units": list(self.f32_units)} if self.f32_units else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        ranges = {str(k): (float(v[0]), float(v[1])) for k, v in data["ranges"].items()}
        units = tuple(int(n) for n in data.get("f32_units", ()))
        return cls(str(data["digest"]), ranges, units)


@dataclass(frozen=True)
class Plan:
    """Disjoint regions covering every node of the model's DataflowGraph."""

    model: str
    fingerprint: str
    config: CompilationConfig
    regions: tuple[Region, ...]
    versions: dict[str, str] = field(default_factory=tool_versions, compare=False)
    notes: dict[str, Any] = field(default_factory=dict, compare=False)
    model_file: ModelFile | None = None  # set: the model's own ONNX graph, whole (``ModelFile``)
    calibration: Calibration | None = None  # set: the ranges of its int8 regions

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.scope.compute_precision for r in self.regions))

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.backend for r in self.regions))

    def estimated_cost_s(self) -> float | None:
        costs = [r.cost_s for r in self.regions]
        return None if any(c is None for c in costs) else sum(costs)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "config": self.config.to_json(),
            "regions": [r.to_json() for r in self.regions],
            "versions": self.versions,
            "notes": self.notes,
        }
        if self.calibration is not None:
            out["calibration"] = self.calibration.to_json()
        return out | ({"model_file": self.model_file.to_json()} if self.model_file else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        if isinstance(data, dict) and data.get("format") == SHAPES_FORMAT:
            raise PlanError(
                f"this plan file holds {len(data.get('buckets', []))} shape buckets, one plan per "
                "tuned shape: export it (`partune export`), or run one bucket's shapes"
            )
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"not a Partune plan (expected format '{FORMAT}')")
        try:
            return cls(
                model=data["model"],
                fingerprint=data["fingerprint"],
                config=CompilationConfig.from_json(data["config"]),
                regions=tuple(Region.from_json(r) for r in data["regions"]),
                versions=dict(data.get("versions", {})),
                notes=dict(data.get("notes", {})),
                model_file=ModelFile.from_json(data["model_file"])
                if data.get("model_file")
                else None,
                calibration=Calibration.from_json(data["calibration"])
                if data.get("calibration")
                else None,
            )
        except (KeyError, TypeError, ValueError, ScopeError) as e:
            raise PlanError(f"malformed plan: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(read_plan_json(path))

    def validate(self, graph: DataflowGraph, known_backends: tuple[str, ...]) -> None:
        """Raise PlanError unless this plan fits ``graph`` and names only known backends."""
        if self.fingerprint != graph.fingerprint:
            raise PlanError(
                f"plan is for another model (fingerprint {self.fingerprint}, "
                f"model has {graph.fingerprint})"
            )
        owner: dict[int, int] = {}
        for r_index, region in enumerate(self.regions):
            if region.scope.backend not in known_backends:
                raise PlanError(
                    f"plan names unknown backend '{region.scope.backend}' "
                    f"(known: {', '.join(known_backends)})"
                )
            for node in region.nodes:
                if not 0 <= node < len(graph):
                    raise PlanError(f"plan names node {node}, model has {len(graph)} nodes")
                if node in owner:
                    raise PlanError(f"node {node} is in two regions ({owner[node]} and {r_index})")
                owner[node] = r_index
        missing = [i for i in range(len(graph)) if i not in owner]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise PlanError(
                f"plan leaves {len(missing)} node(s) uncovered: "
                f"{', '.join(map(str, missing[:5]))}{more}"
            )
        region_order(graph, self.regions)  # raises on cyclic region dependencies


def read_plan_json(path: str | Path) -> Any:
    """A plan file's JSON, or a PlanError saying why it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PlanError(f"cannot read plan {path}: {e.strerror}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan {path} is not JSON: {e.msg} at line {e.lineno}") from e


def region_order(graph: DataflowGraph, regions: tuple[Region, ...]) -> list[int]:
    """A topological order of regions (ties by smallest node); PlanError when cyclic.

    Each region must be convex and the regions together acyclic, or no program can run
    them one after another.
    """
    owner = {n: i for i, r in enumerate(regions) for n in r.nodes}
    deps: list[set[int]] = [set() for _ in regions]
    for i, region in enumerate(regions):
        for n in region.nodes:
            for p in graph.nodes[n].inputs:
                if owner[p] != i:
                    deps[i].add(owner[p])
    order, done = [], set()
    pending = sorted(range(len(regions)), key=lambda i: min(regions[i].nodes, default=0))
    while pending:
        ready = next((i for i in pending if deps[i] <= done), None)
        if ready is None:
            raise PlanError("plan regions depend on each other in a cycle (a region is not convex)")
        order.append(ready)
        done.add(ready)
        pending.remove(ready)
    return order


def contiguous_runs(nodes: list[int]) -> list[tuple[int, ...]]:
    """Split sorted node indices into runs of consecutive indices.

    A run of consecutive nodes in post-DFS order is always convex: a path leaving it and
    coming back would pass a node ordered between two of its members.
    """
    runs: list[list[int]] = []
    for n in sorted(nodes):
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return [tuple(r) for r in runs]


def model_file_plan(
    model: str,
    graph: DataflowGraph,
    config: CompilationConfig,
    file: ModelFile,
    notes: dict[str, Any] | None = None,
) -> Plan:
    """The plan that runs the model's own ONNX graph under ``file.library``: one region of
    every node (so it validates like any plan), built from the file, not from Relax. Its scope
    computes in the file's precision (so the plan's makeup says int8 or bf16 where it is)."""
    precision = file.compute_precision
    scope = next(
        (
            s
            for s in config.primitives
            if s.backend == file.library and s.compute_precision == precision
        ),
        SEScope(device_type="cpu", backend=file.library, precision=precision),
    )
    return Plan(
        model,
        graph.fingerprint,
        config,
        (Region(tuple(range(len(graph))), scope),),
        notes=notes or {},
        model_file=file,
    )


def single_backend_plan(
    model: str,
    graph: DataflowGraph,
    config: CompilationConfig,
    backend: str,
    accepted: set[int],
    precision: str = "f32",
    threads: int | None = None,
) -> Plan:
    """All that ``backend`` accepts goes to it (in convex runs, computing in ``precision``, on
    ``threads`` threads or the job's), the rest to the default."""
    fallback = config.default
    scope = config.scope_for(backend, precision, threads)
    regions = []
    if backend == fallback.backend:
        accepted = set(range(len(graph)))
    for run in contiguous_runs(list(accepted)):
        regions.append(Region(run, scope))
    for run in contiguous_runs([i for i in range(len(graph)) if i not in accepted]):
        regions.append(Region(run, fallback))
    regions.sort(key=lambda r: r.nodes[0])
    return Plan(
        model,
        graph.fingerprint,
        config,
        tuple(regions),
        notes={
            "kind": f"single-backend {backend}"
            + ("" if precision == "f32" else f" {precision}")
            + (f" {threads}t" if threads else "")
        },
    )
