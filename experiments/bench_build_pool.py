"""Does building ahead pay? Candidate measuring with and without a build pool.

For each model: the candidates ``partune.search.collage`` measures (``enumerate_candidates`` over
the backends, ``schedulable``, small regions first, deduplicated by candidate key), or an
evenly spread sample of them (``--sample``) or the first N (``--limit``). Each is measured
as ``tune``'s ``measure_candidates`` does: ``region_request`` with the model's captured
values and ``CANDIDATE_PROTOCOL``, ``store.obtain`` on a fresh MeasurementStore, one
LocalRunner. Arms:

- serial: today: the measuring worker builds each region, then times it;
- pool: a ``BuildPool`` on the spare cores builds ``--window`` candidates ahead into a
  build cache, the measuring worker loads what is there (``partune.runners.build_pool.Lookahead``);
- serial again (unless ``--no-control``): the first arm repeated, so the pool's effect on
  the costs can be told from run-to-run noise.

The arms are interleaved in blocks of ``--block`` candidates (their order rotated per
block), so load that comes and goes on this shared machine touches them alike, after an
uncounted pass that builds and calls every candidate once (first uses in a process,
e.g. an op's first dispatch in torch, cost up to 0.6 s and would fall on one arm). One
measuring worker serves all arms, pinned where ``split_cores`` puts it (the last core);
this script's own thread (it makes the requests, between measurements) is not pinned
(``unpin_search_process``: TVM would bind it to core 0, the build core).
Reported: wall time per arm, the seconds the measuring worker spent building, how many
builds the pool served, and per candidate the cost ratio (fastest sample) of each arm to
the first. Writes experiments/results/build_pool.md and build_pool.json.

    python experiments/bench_build_pool.py [MODEL ...] [--sample N | --limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partune.runners.protocol import RegionRequest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"


def candidates(model, backends: list[str], args) -> dict:
    """key -> candidate, in the order tune measures them."""
    from partune.core.keys import candidate_key
    from partune.core.scopes import CompilationConfig
    from partune.search.candidates import enumerate_candidates
    from partune.search.dp import schedulable

    config = CompilationConfig.for_cpu(backends, 1)
    cands = [c for c in enumerate_candidates(model.mod, model.graph, config) if schedulable(c)]
    todo: dict = {}
    for c in sorted(cands, key=lambda c: (len(c.subgraph), c.subgraph.nodes[0])):
        todo.setdefault(candidate_key(model.graph, c.subgraph.nodes, c.scope), c)
    keys = list(todo)
    if args.limit:
        keys = keys[: args.limit]
    elif args.sample and args.sample < len(keys):
        step = len(keys) / args.sample
        keys = [keys[int(i * step)] for i in range(args.sample)]
    return {k: todo[k] for k in keys}


ARMS = ("serial", "pool", "serial again")


def measure(model, cands: dict, values, args) -> dict:
    """Every arm over the candidates, interleaved in blocks; per arm what it measured and saw.

    One measuring worker serves every arm (same process, same core); the pool idles while
    a serial arm runs. Blocks of ``--block`` candidates, the arms' order rotated per block,
    so a neighbour's load drifting over the run touches every arm alike. Each arm has its
    own fresh store (and the pool its own fresh build cache).
    """
    from partune.core.versions import device_fingerprint
    from partune.runners.build_pool import BuildPool, Lookahead, split_cores
    from partune.runners.builder import region_request
    from partune.runners.local import LocalRunner
    from partune.runners.protocol import ErrorReply
    from partune.runners.timing import Measurement, Protocol
    from partune.search.session import CANDIDATE_PROTOCOL
    from partune.store.measurements import MeasurementStore

    arms = ARMS[:2] if args.no_control else ARMS
    measure_cpus, build_cpus = split_cores(1)
    keys = list(cands)
    blocks = [keys[i : i + args.block] for i in range(0, len(keys), args.block)]
    with tempfile.TemporaryDirectory(prefix="partune-bench-pool-") as tmp:
        stores = {
            a: MeasurementStore(f"sqlite:///{tmp}/{i}.db", device_fingerprint(1))
            for i, a in enumerate(arms)
        }
        pool = BuildPool(os.path.join(tmp, "cache"), args.workers, cpus=build_cpus)
        runner = LocalRunner(timeout_s=300.0, cpus=measure_cpus)
        runner.start()  # imports paid before any clock
        pool.started(300.0)
        out = {a: {"wall_s": 0.0, "measurements": {}, "infos": {}, "loads": []} for a in arms}

        def make(k: str) -> dict:
            c = cands[k]
            return region_request(
                model.mod,
                model.graph,
                c.subgraph.nodes,
                c.scope,
                CANDIDATE_PROTOCOL,
                values or None,
            )

        # Warm-up, not counted: first uses in a process (imports, plugin loads, an op's
        # first dispatch in torch: up to 0.6 s) would fall on whichever arm comes first.
        # Every candidate once, built and called once, in the measuring worker; the pool
        # builds marked copies (so nothing it builds now serves a candidate later).
        firsts = {c.backend: k for k, c in reversed(cands.items())}
        pool.prefetch([_marked(make(k)) for k in firsts.values()])
        if not args.no_warm_up:
            once = {
                "warmup": 1,
                "warmup_ms": 0.0,
                "repeat": 1,
                "min_repeat_ms": 0.0,
                "max_number": 1,
            }
            for k in keys:
                runner.exchange(replace(make(k), protocol=Protocol(**once)))
        pool.join(300.0)
        for b, block in enumerate(blocks):
            wait_for_quiet(args.max_load)
            for arm in arms[b % len(arms) :] + arms[: b % len(arms)]:
                r = out[arm]
                ahead = Lookahead(pool if arm == "pool" else None, block, make, window=args.window)

                def take(k: str, r=r, ahead=ahead) -> Measurement:
                    reply = runner.exchange(ahead.request(k))
                    build = getattr(reply, "build", None)
                    r["infos"][k] = (
                        {"cache": build.cache, "build_s": build.build_s or 0.0} if build else {}
                    )
                    if isinstance(reply, ErrorReply):
                        return Measurement.failed(reply.error)
                    return reply.measurement

                r["loads"].append(os.getloadavg()[0])
                start = time.monotonic()
                for k in block:
                    m, _ = stores[arm].obtain(
                        k, lambda k=k, take=take: take(k), f"{model.name} {cands[k]}"
                    )
                    r["measurements"][k] = m
                r["wall_s"] += time.monotonic() - start
                if arm == "pool":
                    pool.join(300.0)  # nothing left building while a serial arm runs
            print(
                f"  block {b + 1}/{len(blocks)}: "
                + ", ".join(f"{a} {out[a]['wall_s']:.1f} s" for a in arms),
                flush=True,
            )
        stats, errors = dict(pool.stats), list(pool.errors)
        cache_mb = sum(f.stat().st_size for f in Path(tmp, "cache").rglob("*") if f.is_file()) / 1e6
        runner.close()
        pool.close()
    for arm, r in out.items():
        r["served"] = sum(str(i.get("cache", "")).startswith("hit") for i in r["infos"].values())
        r["build_s"] = sum(i.get("build_s", 0.0) for i in r["infos"].values())
        r["pool_stats"], r["pool_errors"], r["cache_mb"] = (
            (stats, errors, cache_mb) if arm == "pool" else ({}, [], 0.0)
        )
        r["load"] = [min(r["loads"]), max(r["loads"])]
    return out


def _marked(req: RegionRequest) -> RegionRequest:
    """The same region with an attribute more: another build cache key."""
    import tvm

    func = tvm.ir.load_json(req.module)[req.function].with_attr("partune.warm_up", 1)
    return replace(req, module=tvm.ir.save_json(tvm.IRModule({req.function: func})))


def quantiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

    geo = statistics.geometric_mean(xs)
    return {
        "n": len(xs),
        "p5": q(0.05),
        "p25": q(0.25),
        "median": q(0.5),
        "p75": q(0.75),
        "p95": q(0.95),
        "geomean": geo,
        "within_10pct": sum(0.9 <= x <= 1.1 for x in xs) / len(xs),
    }


def bench_one(spec: str, args) -> dict:
    from partune.frontend.models import load
    from partune.runners.capture import capture_values

    model = load(spec)
    backends = args.backends.split(",")
    cands = candidates(model, backends, args)
    values = capture_values(model.mod, model.graph, model.inputs, backends)
    results = measure(model, cands, values, args)
    for label, r in results.items():
        print(
            f"{spec} {label}: {r['wall_s']:.1f} s, build in measurer {r['build_s']:.1f} s, "
            f"served {r['served']}/{len(cands)}, load {r['load']}",
            flush=True,
        )
    base = results["serial"]["measurements"]
    by_backend: dict = {}
    for c in cands.values():
        by_backend[c.backend] = by_backend.get(c.backend, 0) + 1
    row = {
        "model": spec,
        "candidates": len(cands),
        "by_backend": by_backend,
        "window": args.window,
        "workers": args.workers,
        "arms": {},
    }
    for label, r in results.items():
        ratios = [
            r["measurements"][k].cost_s / base[k].cost_s
            for k in cands
            if base[k].ok and r["measurements"][k].ok and base[k].cost_s > 0
        ]
        per_backend_build = {}
        for k, c in cands.items():
            per_backend_build[c.backend] = per_backend_build.get(c.backend, 0.0) + r["infos"].get(
                k, {}
            ).get("build_s", 0.0)
        by_backend_ratio = {}
        for b in by_backend:
            rs = [
                r["measurements"][k].cost_s / base[k].cost_s
                for k, c in cands.items()
                if c.backend == b and base[k].ok and r["measurements"][k].ok and base[k].cost_s > 0
            ]
            by_backend_ratio[b] = statistics.median(rs) if rs else None
        row["arms"][label] = {
            "median_ratio_by_backend": by_backend_ratio if label != "serial" else None,
            "wall_s": r["wall_s"],
            "build_s_in_measurer": r["build_s"],
            "build_s_by_backend": per_backend_build,
            "served_from_pool": r["served"],
            "pool_stats": r["pool_stats"],
            "pool_errors": r["pool_errors"],
            "failed": sum(not m.ok for m in r["measurements"].values()),
            "load": r["load"],
            "cache_mb": r["cache_mb"],
            "cost_ratio_to_serial": quantiles(ratios) if label != "serial" else None,
            "median_cost_us": statistics.median(
                m.cost_s * 1e6 for m in r["measurements"].values() if m.ok
            ),
        }
    return row


def wait_for_quiet(max_load: float, limit_s: float = 900.0) -> None:
    """Do not start an arm while the machine is busy (another engineer's job)."""
    start = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - start < limit_s:
        time.sleep(15)


def write(rows: list[dict], args) -> None:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        "# Build pool: candidates built ahead of time, beside the measuring worker",
        "",
        f"{os.cpu_count()} cores ({cpu}); measuring worker pinned to the last core, the script "
        f"making the requests unpinned, {args.workers} build worker(s) on the other core(s), "
        f"lookahead window {args.window}; 1 thread per backend; candidates in tune's order, "
        "measured with CANDIDATE_PROTOCOL on the model's captured values, each arm on a fresh "
        f"store (the pool on a fresh build cache). Arms interleaved in blocks of {args.block} "
        "candidates, their order rotated per block; wall = the sum of an arm's blocks. speed-up = "
        "serial wall / arm wall. cost ratio = arm's cost (fastest sample) / serial arm's cost, "
        "per candidate: 'serial again' shows run-to-run noise, 'pool' adds whatever the pool "
        "disturbs.",
        "",
        "| model | candidates | arm | wall s | speed-up | build s in measurer | served by pool | "
        "cost ratio to serial: p5 / median / p95 (geomean; share within 10%) "
        "| 1-min load min/max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = r["arms"]["serial"]["wall_s"]
        for label, a in r["arms"].items():
            q = a["cost_ratio_to_serial"]
            ratio = (
                (
                    f"{q['p5']:.2f} / {q['median']:.3f} / {q['p95']:.2f} ({q['geomean']:.3f}; "
                    f"{q['within_10pct']:.0%})"
                )
                if q
                else "-"
            )
            lines.append(
                f"| {r['model']} | {r['candidates']} | {label} | {a['wall_s']:.1f} | "
                f"{base / a['wall_s']:.2f}x | {a['build_s_in_measurer']:.1f} | "
                f"{a['served_from_pool']} | {ratio} | {a['load'][0]:.2f} / {a['load'][1]:.2f} |"
            )
    lines += ["", "Median cost ratio to the serial arm, by backend:", ""]
    for r in rows:
        for label, a in r["arms"].items():
            if a["median_ratio_by_backend"]:
                lines.append(
                    f"- {r['model']}, {label}: "
                    + ", ".join(
                        f"{b} {v:.3f}"
                        for b, v in a["median_ratio_by_backend"].items()
                        if v is not None
                    )
                )
    lines += [
        "",
        "Build seconds inside the measuring worker, by backend (serial arm -> pool arm):",
        "",
    ]
    for r in rows:
        s, p = r["arms"]["serial"]["build_s_by_backend"], r["arms"]["pool"]["build_s_by_backend"]
        lines.append(
            f"- {r['model']}: "
            + ", ".join(f"{b} {s[b]:.1f} -> {p.get(b, 0):.1f}" for b in s)
            + f"; pool: {r['arms']['pool']['pool_stats']}"
        )
    (RESULTS / "build_pool.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "build_pool.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["bert-small", "resnet50-small"])
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument(
        "--sample", type=int, default=300, help="an evenly spread sample of N candidates (0: all)"
    )
    p.add_argument("--limit", type=int, default=0, help="the first N candidates instead")
    p.add_argument("--window", type=int, default=16, help="candidates built ahead")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--block", type=int, default=100, help="candidates per block of interleaved arms"
    )
    p.add_argument("--no-control", action="store_true", help="skip the second serial arm")
    p.add_argument(
        "--no-warm-up", action="store_true", help="skip the uncounted pass over every candidate"
    )
    p.add_argument(
        "--max-load", type=float, default=1.5, help="wait before an arm while the load is above"
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    from partune.runners.build_pool import unpin_search_process

    unpin_search_process()  # as the search should: TVM would pin this thread to core 0
    rows = [bench_one(spec, args) for spec in args.models]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items()}, default=str))
    if not args.no_write:
        write(rows, args)
        print((RESULTS / "build_pool.md").read_text())


if __name__ == "__main__":
    main()
