"""The ``partune`` command line: run a model under a plan, benchmark plans against peers.

Bad input (unknown model, unreadable file, a plan that does not fit) is reported as one
line on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

EXIT_USAGE = 2


def _setup_threads(threads: int) -> None:
    # TVM, torch and onnxruntime read these when their thread pools start.
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from backends import registry

    registry.set_threads(threads)


def _backend_plan(model, backend: str, threads: int):
    from backends import registry
    from search.graph import main_bindings
    from search.plan import single_backend_plan
    from search.scopes import CompilationConfig

    impl = registry.get(backend)
    accepted = {i for i, b in enumerate(main_bindings(model.mod["main"])) if impl.accepts(b)}
    config = CompilationConfig.for_cpu([backend], threads)
    return single_backend_plan(model.name, model.graph, config, backend, accepted)


def max_abs_error(outputs, reference) -> float:
    import numpy as np

    if len(outputs) != len(reference):
        return float("inf")
    return max(float(np.max(np.abs(np.asarray(o, dtype=np.float64) - r))) if r.size else 0.0
               for o, r in zip(outputs, reference, strict=True))


def cmd_run(args: argparse.Namespace) -> int:
    from partune.models import load
    from runners.builder import build_plan
    from runners.timing import time_callable
    from search.plan import Plan

    model = load(args.model)
    plan = Plan.load(args.plan) if args.plan else _backend_plan(model, args.backend, args.threads)
    built = build_plan(plan, model.mod, model.graph)
    err = max_abs_error(built(model.inputs), model.reference)
    m = time_callable(built.prepare(model.inputs))
    shares = ", ".join(f"{b}: {sum(len(r.nodes) for r in plan.regions if r.backend == b)} nodes"
                       for b in plan.backends)
    print(f"model      {model.name} ({len(model.graph)} nodes, fingerprint {model.graph.fingerprint})")
    print(f"plan       {args.plan or 'single-backend ' + args.backend}: {len(plan.regions)} regions ({shares})")
    print(f"latency    {m.median_s * 1e3:.3f} ms median (IQR {m.spread_s * 1e3:.3f} ms, CPU {m.cpu_s * 1e3:.3f} ms, "
          f"{m.repeats}x{m.number} calls, {args.threads} thread(s))")
    print(f"max |err|  {err:.3g} vs {model.reference_source}")
    if args.save_plan:
        plan.save(args.save_plan)
        print(f"plan saved to {args.save_plan}")
    return 0


@dataclass
class BenchRow:
    name: str
    kind: str
    median_ms: float = float("nan")
    spread_ms: float = float("nan")
    cpu_ms: float = float("nan")
    error: float = float("nan")
    failure: str | None = None


def _bench_one(name: str, kind: str, make: Callable, reference) -> BenchRow:
    """Build one contender and time it; a failure costs this row, not the benchmark."""
    from runners.timing import time_callable

    row = BenchRow(name, kind)
    try:
        run, outputs = make()
        row.error = max_abs_error(outputs, reference)
        m = time_callable(run)
        row.median_ms, row.spread_ms, row.cpu_ms = m.median_s * 1e3, m.spread_s * 1e3, m.cpu_s * 1e3
    except Exception as e:  # noqa: BLE001 - one failing peer must not end the benchmark
        row.failure = (str(e).strip().splitlines() or [type(e).__name__])[-1][:120]
    return row


def format_table(rows: list[BenchRow]) -> str:
    ok = [r for r in rows if r.failure is None]
    best = min((r.median_ms for r in ok), default=float("nan"))
    head = f"| {'contender':<28} | {'kind':<12} | {'median ms':>9} | {'IQR ms':>7} | {'CPU ms':>8} | {'max abs err':>11} | {'x fastest':>9} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in sorted(rows, key=lambda r: (r.failure is not None, r.median_ms)):
        if r.failure:
            lines.append(f"| {r.name:<28} | {r.kind:<12} | failed: {r.failure}")
            continue
        lines.append(f"| {r.name:<28} | {r.kind:<12} | {r.median_ms:9.3f} | {r.spread_ms:7.3f} | "
                     f"{r.cpu_ms:8.3f} | {r.error:11.2e} | {r.median_ms / best:9.2f} |")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from backends import registry
    from partune.models import load
    from runners import peers
    from runners.builder import build_plan

    model = load(args.model)
    backends = args.backends.split(",") if args.backends else list(registry.names())
    for b in backends:
        registry.get(b)  # unknown names fail here, before any work
    todo: list[tuple[str, str, Callable]] = []
    for b in backends:
        def make(b=b):
            built = build_plan(_backend_plan(model, b, args.threads), model.mod, model.graph)
            return built.prepare(model.inputs), built(model.inputs)
        todo.append((f"partune {b}-only plan", "plan", make))
    wanted = set(args.peers.split(",")) if args.peers else {"torch", "torch.compile", "onnxruntime"}
    if model.torch_module is not None and "torch" in wanted:
        todo.append(("torch eager", "peer", lambda: _peer_run(peers.torch_eager(model.torch_module, model.inputs, args.threads))))
    if model.torch_module is not None and "torch.compile" in wanted:
        todo.append(("torch.compile (inductor)", "peer", lambda: _peer_run(peers.torch_compile(model.torch_module, model.inputs, args.threads))))
    if "onnxruntime" in wanted and (model.onnx_bytes is not None or model.torch_module is not None):
        def ort():
            data = model.onnx_bytes or peers.onnx_export(model.torch_module, model.inputs)
            return _peer_run(peers.onnxruntime_session(data, model.inputs, args.threads))
        todo.append(("onnxruntime (whole model)", "peer", ort))
    rows = []
    for name, kind, make in tqdm(todo, desc=f"bench {model.name}", unit="contender", file=sys.stderr):
        rows.append(_bench_one(name, kind, make, model.reference))
    print(f"{model.name}: {len(model.graph)} nodes, batch 1, {args.threads} thread(s), "
          f"reference {model.reference_source}; x fastest = median / fastest median")
    print(format_table(rows))
    return 0


def _peer_run(run):
    from partune.models import _flatten

    return run, _flatten(run())


def parse_duration(text: str) -> float:
    """'90s', '15m', '8h', '1d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        from search.errors import PartuneError

        raise PartuneError(f"bad duration '{text}': use e.g. 90s, 15m, 8h") from None


def parse_pins(specs: list[str], model) -> dict:
    """--pin SELECTOR=BACKEND; SELECTOR is a node index, a range a-b, or an op name."""
    from search.errors import PartuneError
    from search.scopes import SEScope

    pins = {}
    for spec in specs or []:
        sel, _, backend = spec.partition("=")
        if not backend:
            raise PartuneError(f"bad --pin '{spec}': expected SELECTOR=BACKEND")
        if sel.isdigit():
            nodes = [int(sel)]
        elif "-" in sel and sel.replace("-", "").isdigit():
            a, b = sel.split("-")
            nodes = list(range(int(a), int(b) + 1))
        else:
            nodes = [n.index for n in model.graph.nodes if n.op == sel]
        if not nodes or any(not 0 <= n < len(model.graph) for n in nodes):
            raise PartuneError(f"--pin '{spec}' selects no node of {model.name}")
        for n in nodes:
            pins[n] = SEScope(backend=backend)
    return pins


def make_runner(spec: str, timeout_s: float, threads: int):
    from runners.local import LocalRunner
    from search.errors import PartuneError

    if spec == "local":
        return LocalRunner(timeout_s=timeout_s, threads=threads)
    if spec.startswith("rpc://"):
        from runners.rpc import RPCRunner

        address, _, key = spec[len("rpc://"):].partition("/")
        if not key:
            raise PartuneError(f"bad runner '{spec}': expected rpc://HOST:PORT/KEY")
        return RPCRunner(address, key, timeout_s=timeout_s, threads=threads)
    raise PartuneError(f"unknown runner '{spec}': use local or rpc://HOST:PORT/KEY")


class _Bars:
    """tqdm progress bars, one per phase of the search."""

    def __init__(self) -> None:
        self.bar = None

    def start_phase(self, name: str, total: int) -> None:
        from tqdm import tqdm

        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(total=total, desc=name, unit="run", file=sys.stderr, dynamic_ncols=True)

    def advance(self, status: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(status[:60], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summarise(result, model) -> str:
    """The closing summary: where time goes per backend, the plan against the others."""
    plan = result.plan
    lines = [f"plan for {model.name}: {plan.notes.get('chosen_as')}, "
             f"{plan.notes['measured_s'] * 1e3:.3f} ms measured end to end"]
    if result.cover is not None:
        measured = result.end_to_end.get("partune dp")
        est = result.cover.cost_s * 1e3
        lines.append(f"DP estimate {est:.3f} ms vs measured "
                     + (f"{measured.median_s * 1e3:.3f} ms" if measured and measured.ok else "n/a")
                     + f" ({result.cover.states} DP states)")
    known = plan.estimated_cost_s()
    lines.append(f"| {'backend':<12} | {'regions':>7} | {'ops':>5} | {'share of time':>13} |")
    lines.append("|--------------|---------|-------|---------------|")
    for b in plan.backends:
        regs = [r for r in plan.regions if r.backend == b]
        share = f"{sum(r.cost_s or 0.0 for r in regs) / known:>12.1%}" if known else f"{'-':>13}"
        lines.append(f"| {b:<12} | {len(regs):>7} | {sum(len(r.nodes) for r in regs):>5} | {share} |")
    best = min(m.median_s for m in result.end_to_end.values() if m.ok)
    lines.append("")
    lines.append(f"| {'plan':<16} | {'end to end ms':>13} | {'x fastest':>9} |")
    lines.append("|------------------|---------------|-----------|")
    for label, m in sorted(result.end_to_end.items(), key=lambda kv: kv[1].median_s):
        ms = f"{m.median_s * 1e3:13.3f}" if m.ok else f"{'failed':>13}"
        ratio = f"{m.median_s / best:9.2f}" if m.ok else f"{'-':>9}"
        lines.append(f"| {label:<16} | {ms} | {ratio} |")
    lines.append("")
    lines.append(f"search {result.search_s:.1f} s; candidates {result.candidates}; measurements made "
                 f"{result.measured} ({result.failed} failed), reused {result.reused}"
                 + ("; stopped early at --timeout" if result.timed_out else ""))
    return "\n".join(lines)


def cmd_tune(args: argparse.Namespace) -> int:
    import time

    import optuna

    from backends import registry
    from partune.models import load
    from search.store import MeasurementStore, device_fingerprint
    from search.tune import Progress, tune

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        registry.get(b)
    deadline = time.monotonic() + parse_duration(args.timeout) if args.timeout else None
    model = load(args.model)
    pins = parse_pins(args.pin, model)
    store = MeasurementStore(args.storage, device_fingerprint(args.threads))
    bars = _Bars()
    runner = make_runner(args.runner, parse_duration(args.measure_timeout), args.threads)
    try:
        result = tune(model, backends, runner, store, threads=args.threads, pins=pins,
                      deadline=deadline, progress=Progress(bars.start_phase, bars.advance))
    finally:
        bars.close()
        runner.close()
    result.plan.save(args.output)
    study = optuna.create_study(study_name=args.study or f"{model.name}:{','.join(backends)}",
                                storage=store.storage, load_if_exists=True)
    study.set_user_attr("best_plan", result.plan.to_json())
    print(summarise(result, model))
    print(f"plan written to {args.output}")
    return 0


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from runners.rpc import serve

    serve(args.tracker, args.key, host=args.host, port=args.port, port_end=args.port_end)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from partune.zoo import ZOO

    for name in sorted(ZOO):
        print(f"{name:<22} {ZOO[name].family:<12} {ZOO[name].description}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from backends import registry

    for name in registry.names():
        b = registry.get(name)
        print(f"{name:<12} level={b.level.value:<9} fusion={b.fusion_style.value:<9} "
              f"devices={','.join(b.device_types)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partune",
        description="Decide which backend runs which part of a deep-learning model, by measuring.",
        epilog="MODEL is a zoo name (see `partune models`) or a path to an .onnx, .pt2 "
               "(torch ExportedProgram) or TVMScript (.py/.tvmscript/.relax) file.")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for every backend and peer (default 1: the stable setting on small machines)")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a model under a plan; print latency and error vs the reference")
    r.add_argument("model", metavar="MODEL")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a plan JSON file (from `partune tune` or --save-plan)")
    g.add_argument("--backend", default="tvm",
                   help="single-backend plan: all this backend accepts, the rest to tvm (default tvm)")
    r.add_argument("--save-plan", metavar="FILE", help="write the plan that was run as JSON")
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="time each single-backend plan and the usual peers in one run")
    b.add_argument("model", metavar="MODEL")
    b.add_argument("--backends", help="comma-separated backends for single-backend plans (default: all)")
    b.add_argument("--peers", help="comma-separated peers: torch,torch.compile,onnxruntime (default: all)")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="search the fastest partitioning (Collage DP on measured candidates)",
                       description="Enumerate candidate regions per backend, measure each once "
                       "(stored in Optuna storage and reused by every later run), pick the cheapest "
                       "cover by DP, check it end to end against every single-backend plan, and "
                       "write the fastest plan. Interrupt and rerun to resume.")
    t.add_argument("model", metavar="MODEL")
    t.add_argument("--backends", default="tvm,torch,onnxruntime",
                   help="comma-separated backends on offer (default tvm,torch,onnxruntime)")
    t.add_argument("--storage", default="sqlite:///partune.db",
                   help="Optuna storage URL for measurements (default sqlite:///partune.db; "
                        "postgresql://... for many workers)")
    t.add_argument("--study", help="name of this tuning job in the storage (default MODEL:BACKENDS)")
    t.add_argument("--runner", default="local", help="local, or rpc://HOST:PORT/KEY for a TVM RPC tracker")
    t.add_argument("--timeout", help="stop measuring candidates after this long (e.g. 30m, 8h)")
    t.add_argument("--measure-timeout", default="120s",
                   help="limit for one measurement; a hang costs that candidate (default 120s)")
    t.add_argument("--pin", action="append", metavar="SELECTOR=BACKEND",
                   help="keep nodes on a backend: a node index, a range a-b, or an op name (repeatable)")
    t.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    t.set_defaults(func=cmd_tune)

    s = sub.add_parser("rpc-server", help="serve measurements to `partune tune --runner rpc://...`")
    s.add_argument("--tracker", required=True, metavar="HOST:PORT", help="the TVM RPC tracker to register with")
    s.add_argument("--key", required=True, help="device key clients ask the tracker for")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=9190, help="first port to try (default 9190)")
    s.add_argument("--port-end", type=int, default=9290, help="last port to try (default 9290)")
    s.set_defaults(func=cmd_rpc_server)

    sub.add_parser("models", help="list the built-in model zoo").set_defaults(func=cmd_models)
    sub.add_parser("backends", help="list the registered backends").set_defaults(func=cmd_backends)
    return p


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export chatter
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print("partune: error: --threads must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    _setup_threads(args.threads)
    from backends.registry import UnknownBackendError
    from search.errors import PartuneError

    try:
        return args.func(args)
    except (PartuneError, UnknownBackendError) as e:
        print(f"partune: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("partune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
