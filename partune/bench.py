"""Single-backend plans against the tools a user would pick instead, in one run.

Every contender is timed by the same protocol in the same process, one after another,
and reported as a ratio to the fastest: numbers from different runs never mix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

PEERS = ("torch", "torch.compile", "onnxruntime", "openvino")


@dataclass
class BenchRow:
    name: str
    kind: str
    median_ms: float = float("nan")
    best_ms: float = float("nan")
    spread_ms: float = float("nan")
    cpu_ms: float = float("nan")
    error: float = float("nan")
    failure: str | None = None


def max_abs_error(outputs, reference) -> float:
    import numpy as np

    if len(outputs) != len(reference):
        return float("inf")
    return max(
        float(np.max(np.abs(np.asarray(o, dtype=np.float64) - r))) if r.size else 0.0
        for o, r in zip(outputs, reference, strict=True)
    )


def _bench_one(name: str, kind: str, make: Callable, reference) -> BenchRow:
    """Build one contender and time it; a failure costs this row, not the benchmark."""
    from partune.core import clean_error, last_line
    from partune.runners import time_callable

    row = BenchRow(name, kind)
    try:
        run, outputs = make()
        row.error = max_abs_error(outputs, reference)
        m = time_callable(run)
        row.median_ms, row.spread_ms, row.cpu_ms = m.median_s * 1e3, m.spread_s * 1e3, m.cpu_s * 1e3
        row.best_ms = m.cost_s * 1e3
    except Exception as e:  # noqa: BLE001 - one failing peer must not end the benchmark
        row.failure = clean_error(last_line(e), 120)
    return row


def _peer(run):
    from partune.core import flatten_outputs

    return run, flatten_outputs(run())


def contenders(model, backends: list[str] | None, peers: list[str] | None, threads: int):
    """(name, kind, make) for each single-backend plan and each peer."""
    from partune.backends import registry
    from partune.core import CompilationConfig
    from partune.runners import build_plan
    from partune.runners import peers as p
    from partune.search import backend_plan

    backends = backends or registry.default_names()
    for b in backends:
        registry.get(b)  # unknown names fail here, before any work
    out: list[tuple[str, str, Callable]] = []
    for b in backends:

        def make(b=b):
            config = CompilationConfig.for_cpu([b], threads)
            plan = backend_plan(model.name, model.mod, model.graph, config, b)
            built = build_plan(plan, model.mod, model.graph)
            return built.prepare(model.inputs), built(model.inputs)

        out.append((f"partune {b}-only plan", "plan", make))
    for label, spec in p.peer_specs(model, tuple(peers or PEERS)).items():
        out.append(
            (label, "peer", lambda spec=spec: _peer(p.make_peer(spec, model.inputs, threads)))
        )
    return out


def bench(
    model,
    backends: list[str] | None = None,
    peers: list[str] | None = None,
    threads: int = 1,
    progress: bool = False,
) -> list[BenchRow]:
    from tqdm import tqdm

    todo = contenders(model, backends, peers, threads)
    it = (
        tqdm(todo, desc=f"bench {model.name}", unit="contender", file=sys.stderr)
        if progress
        else todo
    )
    return [_bench_one(name, kind, make, model.reference) for name, kind, make in it]


def format_table(rows: list[BenchRow]) -> str:
    """A Markdown table, fastest first."""
    ok = [r for r in rows if r.failure is None]
    best = min((r.median_ms for r in ok), default=float("nan"))
    head = (
        f"| {'contender':<30} | {'kind':<4} | {'median ms':>9} | {'best ms':>9} | {'IQR ms':>7} | "
        f"{'CPU ms':>8} | {'max abs err':>11} | {'x fastest':>9} |"
    )
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in sorted(rows, key=lambda r: (r.failure is not None, r.median_ms)):
        if r.failure:
            lines.append(f"| {r.name:<30} | {r.kind:<4} | failed: {r.failure} | | | | | |")
            continue
        lines.append(
            f"| {r.name:<30} | {r.kind:<4} | {r.median_ms:9.3f} | {r.best_ms:9.3f} | "
            f"{r.spread_ms:7.3f} | {r.cpu_ms:8.3f} | {r.error:11.2e} | {r.median_ms / best:9.2f} |"
        )
    return "\n".join(lines)
