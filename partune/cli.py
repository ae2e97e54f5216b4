"""The ``partune`` command line: run a model under a plan, benchmark plans against peers.

Bad input (unknown model, unreadable file, a plan that does not fit) is reported as one
line on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path

EXIT_USAGE = 2
DEFAULT_TUNE_BUDGET_S = 600.0  # when tvm-tuned is named without --tune-budget
NOISE = 0.03  # ratios closer to 1 than this are ties: run-to-run noise of interleaved medians


def _setup_threads(threads: int) -> None:
    # TVM, torch and onnxruntime read these when their thread pools start.
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from partune.backends import registry

    registry.set_threads(threads)


def parse_input_shapes(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """--input-shape NAME=D1,D2,... (repeatable)."""
    from partune.core.errors import PartuneError

    shapes = {}
    for spec in specs or []:
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.replace("x", ",").split(","))
        except ValueError:
            raise PartuneError(f"bad --input-shape '{spec}': expected NAME=D1,D2,... e.g. input_ids=1,128") from None
        if not name or any(d < 1 for d in shapes[name]):
            raise PartuneError(f"bad --input-shape '{spec}': expected NAME=D1,D2,... with positive sizes")
    return shapes


def load_model(args: argparse.Namespace):
    """The model named on the command line; dimensions it left open are reported."""
    from partune.models import load

    model = load(args.model, parse_input_shapes(args.input_shape))
    for note in model.assumed:
        print(f"partune: note: {note} (set it with --input-shape)", file=sys.stderr)
    return model


def _backend_plan(model, backend: str, threads: int):
    from partune.core.scopes import CompilationConfig
    from partune.search.candidates import backend_plan

    config = CompilationConfig.for_cpu([backend], threads)
    return backend_plan(model.name, model.mod, model.graph, config, backend)


def cmd_run_deployed(args: argparse.Namespace) -> int:
    """Run a deploy directory: only partune.deployed and the backends are imported."""
    import numpy as np

    from partune.deployed import DeployError, load
    from partune.runners.timing import time_callable

    model = load(args.model, args.threads)
    m = model.manifest
    if args.input:
        try:
            inputs = [np.load(f, allow_pickle=False) for f in args.input]
        except (OSError, ValueError) as e:
            raise DeployError(f"cannot read --input: {e}") from e
    else:
        inputs = model.example_inputs()
    outputs = model(*inputs)
    m_time = time_callable(model.prepare(*inputs))
    m_numpy = time_callable(lambda: model(*inputs))
    if file := m.get("model_file"):
        print(f"deployed   {m['model']} (the model's own ONNX graph, {file['origin']}, under {file['library']})")
    else:
        print(f"deployed   {m['model']} ({len(m['regions'])} library regions: {', '.join(m['backends']) or 'none'}; "
              f"plan backends {', '.join(m['plan_backends'])})")
    print(f"latency    {m_time.median_s * 1e3:.3f} ms median, {m_time.cost_s * 1e3:.3f} ms best "
          f"({args.threads} thread(s); {m_numpy.median_s * 1e3:.3f} ms median with numpy in and out)")
    if not args.input:
        from partune.bench import max_abs_error

        err = max_abs_error(outputs, model.reference_outputs())
        print(f"max |err|  {err:.3g} vs {m['reference']} (example inputs)")
    for i, o in enumerate(outputs):
        if args.output:
            np.save(f"{args.output}_{i}.npy", o)
        print(f"output {i}   {o.dtype}{list(o.shape)}" + (f" -> {args.output}_{i}.npy" if args.output else ""))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.model):
        return cmd_run_deployed(args)
    from partune.bench import max_abs_error
    from partune.core.plan import Plan
    from partune.runners.builder import build_plan
    from partune.runners.timing import time_callable

    model = load_model(args)
    plan = Plan.load(args.plan) if args.plan else _backend_plan(model, args.backend, args.threads)
    if plan.model_file is not None:  # the model's own ONNX graph under one library
        from partune.backends import registry
        from partune.runners.builder import build_model_file
        from partune.runners.peers import model_onnx

        plan.validate(model.graph, registry.names())
        built = build_model_file(plan, model_onnx(model), model.inputs, args.threads)
    else:
        built = build_plan(plan, model.mod, model.graph)
    err = max_abs_error(built(model.inputs), model.reference)
    m = time_callable(built.prepare(model.inputs))
    shares = ", ".join(f"{b}: {sum(len(r.nodes) for r in plan.regions if r.backend == b)} nodes"
                       for b in plan.backends)
    print(f"model      {model.name} ({len(model.graph)} nodes, fingerprint {model.graph.fingerprint})")
    what = (f"the model's own ONNX graph ({plan.model_file.origin}) under {plan.model_file.library}"
            if plan.model_file else f"{len(plan.regions)} regions ({shares})")
    print(f"plan       {args.plan or 'single-backend ' + args.backend}: {what}")
    print(f"latency    {m.median_s * 1e3:.3f} ms median, {m.cost_s * 1e3:.3f} ms best "
          f"(IQR {m.spread_s * 1e3:.3f} ms, CPU {m.cpu_s * 1e3:.3f} ms, "
          f"{m.repeats}x{m.number} calls, {args.threads} thread(s))")
    print(f"max |err|  {err:.3g} vs {model.reference_source}")
    if args.save_plan:
        plan.save(args.save_plan)
        print(f"plan saved to {args.save_plan}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from partune.bench import bench, format_table

    model = load_model(args)
    backends = args.backends.split(",") if args.backends else None
    peers = args.peers.split(",") if args.peers else None
    rows = bench(model, backends, peers, args.threads, progress=True)
    print(f"{model.name}: {len(model.graph)} nodes, batch 1, {args.threads} thread(s), "
          f"reference {model.reference_source}; x fastest = median / fastest median")
    print(format_table(rows))
    return 0


def parse_duration(text: str) -> float:
    """'90s', '15m', '8h', '1d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        from partune.core.errors import PartuneError

        raise PartuneError(f"bad duration '{text}': use e.g. 90s, 15m, 8h") from None


def parse_pins(specs: list[str], model) -> dict:
    """--pin SELECTOR=BACKEND; SELECTOR is a node index, a range a-b, or an op name."""
    from partune.core.errors import PartuneError
    from partune.core.scopes import SEScope

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


def make_runner(spec: str, timeout_s: float, threads: int, cpus: list[int] | None = None):
    """The runner ``--runner`` names; ``cpus`` pins a local runner's worker (beside a build pool)."""
    from partune.core.errors import PartuneError
    from partune.runners.local import LocalRunner

    if spec == "local":
        return LocalRunner(timeout_s=timeout_s, threads=threads, cpus=cpus)
    if spec.startswith("rpc://"):
        from partune.runners.rpc import RPCRunner

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
    if result.dp_label is not None and result.dp_estimate_s is not None:
        measured = result.end_to_end.get(result.dp_label)
        est = result.dp_estimate_s * 1e3
        err = (f" ({result.dp_estimate_s / measured.cost_s - 1:+.0%})" if measured and measured.ok else "")
        lines.append(f"DP estimate {est:.3f} ms vs measured "
                     + (f"{measured.cost_s * 1e3:.3f} ms{err}" if measured and measured.ok else "n/a")
                     + f" for '{result.dp_label}' ({result.cover.states} DP states)")
        lines.append(f"border costs learned from the plans measured: {result.border.describe()}")
    if result.adjust_s:
        adj = ", ".join(f"{k} {v * 1e6:+.1f} us" for k, v in result.adjust_s.items())
        lines.append(f"per-region cost in a whole model vs isolated: {adj}")
    known = plan.estimated_cost_s()
    if plan.model_file is not None:
        lines.append(f"NO PARTITIONED PLAN BEAT {plan.notes['chosen_as']}: the plan is the model's own ONNX graph "
                     f"({plan.model_file.origin}) under {plan.model_file.library}, unpartitioned; the best "
                     f"partitioned plan, '{plan.notes.get('best_partitioned')}', ran "
                     + (f"{plan.notes['best_partitioned_median_s'] * 1e3:.3f} ms"
                        if plan.notes.get("best_partitioned_median_s") else "n/a") + " (interleaved medians)")
    lines.append(f"| {'backend':<12} | {'regions':>7} | {'ops':>5} | {'share of time':>13} |")
    lines.append("|--------------|---------|-------|---------------|")
    for b in plan.backends:
        regs = [r for r in plan.regions if r.backend == b]
        share = f"{sum(r.cost_s or 0.0 for r in regs) / known:>12.1%}" if known else f"{'-':>13}"
        lines.append(f"| {b:<12} | {len(regs):>7} | {sum(len(r.nodes) for r in regs):>5} | {share} |")
    best = min(m.cost_s for m in result.end_to_end.values() if m.ok)
    lines.append("")
    lines.append(f"| {'plan':<36} | {'best ms':>9} | {'median ms':>9} | {'x fastest':>9} |")
    lines.append("|" + "-" * 38 + "|-----------|-----------|-----------|")
    for label, m in sorted(result.end_to_end.items(), key=lambda kv: kv[1].cost_s):
        if m.ok:
            lines.append(f"| {label:<36} | {m.cost_s * 1e3:9.3f} | {m.median_s * 1e3:9.3f} | {m.cost_s / best:9.2f} |")
        else:
            lines.append(f"| {label:<36} | {'failed':>9} | {'-':>9} | {'-':>9} |  {m.error}")
    lines.extend(_verdict_lines(result))
    lines.append("")
    lines.append(f"candidates measured on {result.inputs_from} inputs")
    if result.skipped:
        lines.append(f"cost model: {result.skipped} candidates ranked out of measuring")
    if result.tuning_s:
        from partune.backends import registry

        in_plan = sum(registry.get(r.backend).autotuned for r in plan.regions)
        lines.append(f"auto-tuning: {result.tuned_regions} regions tuned ({result.tuning_trials} MetaSchedule "
                     f"trials) in {result.tuning_s:.0f} s; {in_plan} tuned region(s) in the emitted plan")
        if result.achieved:
            lines.append("  speed-up of tuning over default schedules, measured: " + ", ".join(
                f"{kind} {min(s):.1f}-{max(s):.1f}x ({len(s)})" for kind, s in sorted(result.achieved.items())))
    lines.append(f"search {result.search_s:.1f} s; candidates {result.candidates}; measurements made "
                 f"{result.measured} ({result.failed} failed), reused {result.reused}"
                 + ("; stopped early at --timeout" if result.timed_out else ""))
    return "\n".join(lines)


def _verdict_lines(result) -> list[str]:
    """The finalists against the peers (one process, interleaved rounds), said plainly."""
    if not result.verdict:
        return []
    ok = {k: m for k, m in result.verdict.items() if m.ok}
    peer = result.best_peer
    lines = ["", "finalists vs the tools you would use instead (one process, interleaved rounds):",
             f"| {'contender':<36} | {'median ms':>9} | {'best ms':>9} | "
             + (f"{'vs ' + peer:<40} |" if peer else "x fastest |"),
             "|" + "-" * 38 + "|-----------|-----------|"
             + ("-" * 42 + "|" if peer else "-----------|")]
    ref = result.verdict[peer].median_s if peer else min((m.median_s for m in ok.values()), default=1.0)
    for label, m in sorted(result.verdict.items(), key=lambda kv: kv[1].median_s if kv[1].ok else float("inf")):
        kind = "(peer) " if label in result.peers else ""
        if m.ok:
            ratio = ref / m.median_s if peer else m.median_s / ref
            lines.append(f"| {kind + label:<36} | {m.median_s * 1e3:9.3f} | {m.cost_s * 1e3:9.3f} | "
                         + (f"{ratio:>39.2f}x |" if peer else f"{ratio:9.2f} |"))
        else:
            lines.append(f"| {kind + label:<36} | {'unavailable' if kind else 'failed':>9} | {'-':>9} | {m.error}")
    notes = result.plan.notes
    if "speedup_vs_best_peer" in notes:
        x = notes["speedup_vs_best_peer"]
        if result.plan.model_file is not None:
            lines.append(f"the plan is {notes['chosen_as']} itself"
                         + (f", {x:.2f}x as fast as {peer}" if peer != notes["chosen_as"] else ", the best peer"))
        elif x >= 1.0 + NOISE:
            lines.append(f"the plan is {x:.2f}x as fast as {peer}, the best peer (medians)")
        elif x >= 1.0 - NOISE:
            lines.append(f"the plan ties {peer}, the best peer ({x:.2f}x: within {NOISE:.0%}, "
                         "the noise of such measurements)")
        else:
            lines.append(f"NO PLAN BEATS {peer}: the best plan runs at {x:.2f}x its speed; "
                         f"{peer} alone serves this model better on this machine")
    return lines


def beside_store(storage: str, suffix: str) -> str:
    """A path beside an SQLite store (``partune.db`` -> ``partune<suffix>``), else in the
    working directory: where the cost model and the tuning database live."""
    if storage.startswith("sqlite:///") and storage != "sqlite:///:memory:":
        return str(Path(storage[len("sqlite:///"):]).with_suffix(suffix))
    return "partune" + suffix


def _load_cost_model(path: str | None):
    """The cost model at ``path`` (None when there is none yet: this run trains it)."""
    if not path or not os.path.exists(path):
        return None
    from partune.core.errors import PartuneError
    from partune.cost_models.xgboost_model import CostModel

    try:
        return CostModel.load(path)
    except (OSError, ValueError) as e:
        raise PartuneError(f"cannot use cost model {path}: {e}") from None


def _update_cost_model(path: str, cost_model, result, model) -> str:
    """Train on what this run measured (continuing from the loaded model) and save."""
    import numpy as np

    from partune.cost_models.features import featurize
    from partune.cost_models.xgboost_model import CostModel

    done = [(c, m) for c, m in result.trained if m.ok]
    if result.cost_model is not None:  # it learned this run's candidates during the search
        result.cost_model.save(path)
        return (f"cost model: {result.skipped} candidates not measured (ranked out); {path} updated "
                f"in-run with this model's measurements")
    if not done:
        return f"cost model {path}: nothing new to learn"
    x = np.stack([featurize(model.graph, c.subgraph.nodes, c.backend) for c, _ in done])
    y = np.array([m.cost_s for _, m in done])
    updated = (cost_model or CostModel()).update(x, y)
    updated.save(path)
    return (f"cost model: {result.skipped} candidates not measured (ranked out); "
            f"{path} updated with {len(done)} measurements")


def _job(storage, study_name: str, required: bool = True) -> dict:
    """A tuning job's attributes (its best plan, model, input shapes); {} when there is none
    and it is not ``required``."""
    import optuna

    from partune.core.errors import PartuneError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        attrs = optuna.load_study(study_name=study_name, storage=storage).user_attrs
    except KeyError:
        if not required:
            return {}
        raise PartuneError(f"no study '{study_name}' in {storage} (see `partune status`)") from None
    if required and "best_plan" not in attrs:
        raise PartuneError(f"study '{study_name}' has no finished plan yet")
    return attrs


def _previous_plan(storage, study_name: str):
    """The plan an earlier run of this tuning job emitted, if any."""
    from partune.core.plan import Plan

    attrs = _job(storage, study_name, required=False)
    return Plan.from_json(attrs["best_plan"]) if "best_plan" in attrs else None


def _study_summaries(storage: str) -> list:
    """Every study in a storage; an unreachable or corrupt storage is one clear error."""
    import optuna

    from partune.core.errors import PartuneError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as e:  # noqa: BLE001 - sqlalchemy raises many kinds
        raise PartuneError(f"cannot open storage {storage}: {str(e).splitlines()[0][:160]}") from e


def cmd_tune(args: argparse.Namespace) -> int:
    import time

    import optuna

    from partune.backends import registry
    from partune.core.errors import PartuneError
    from partune.core.versions import device_fingerprint
    from partune.runners.peers import PEER_LABELS
    from partune.search.tune import Progress, tune
    from partune.store.measurements import MeasurementStore

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    tune_budget = parse_duration(args.tune_budget) if args.tune_budget else 0.0
    if tune_budget > 0:
        backends += [n for n in registry.names() if registry.get(n).autotuned and n not in backends]
    for b in backends:
        registry.get(b)
    if any(registry.get(b).autotuned for b in backends):
        tune_budget = tune_budget or DEFAULT_TUNE_BUDGET_S
        # Beside the store: tuning records serve every later run and model, like measurements.
        os.environ.setdefault("PARTUNE_TUNING_DATABASE", os.path.abspath(beside_store(args.storage, ".tuning")))
    deadline = time.monotonic() + parse_duration(args.timeout) if args.timeout else None
    model = load_model(args)
    pins = dict(model.pins)
    for node, scope in parse_pins(args.pin, model).items():
        joined = pins[node].join(scope) if node in pins else scope
        if joined is None:
            raise PartuneError(f"--pin puts node {node} on {scope}, the model pins it to {pins[node]}")
        pins[node] = joined
    if args.workers < 1 or args.heartbeat < 1:
        raise PartuneError("--workers and --heartbeat must be at least 1")
    measure_timeout = parse_duration(args.measure_timeout)
    store = MeasurementStore(args.storage, device_fingerprint(args.threads),
                             claim_ttl_s=max(1800.0, 3 * measure_timeout), heartbeat_s=args.heartbeat,
                             retry_failed=args.retry_failed)
    study_name = args.study or f"{model.name}:{','.join(backends)}"
    peers = tuple(p for p in args.peers.split(",") if p and p != "none")
    if unknown := [p for p in peers if p not in PEER_LABELS]:
        raise PartuneError(f"unknown peer(s) {', '.join(unknown)}: use {', '.join(PEER_LABELS)} or none")
    study = optuna.create_study(study_name=study_name, storage=store.storage, load_if_exists=True)
    if not args.worker:
        _job_started(study, args)
    previous = _previous_plan(store.storage, study_name)
    if args.cost_model == "auto":
        args.cost_model = beside_store(args.storage, ".costmodel.json")
    cost_model = _load_cost_model(args.cost_model)
    helpers = _start_workers(args) if args.workers > 1 else []
    bars = _Bars() if not args.worker else None
    pool, measure_cpus = _build_pool(args, measure_timeout)
    runner = make_runner(args.runner, measure_timeout, args.threads, measure_cpus)
    try:
        result = tune(model, backends, runner, store, threads=args.threads, pins=pins, deadline=deadline,
                      progress=Progress(bars.start_phase, bars.advance) if bars else None, peers=peers,
                      refine_trials=args.refine_trials, previous=previous, cost_model=cost_model,
                      memory=args.objective == "latency+memory", worker_only=args.worker,
                      tune_budget_s=tune_budget, tune_trials=args.tune_trials, build_pool=pool)
    except KeyboardInterrupt:
        if not args.worker:
            study.set_user_attr("stopped", time.time())
        raise
    finally:
        if bars:
            bars.close()
        runner.close()
        notes = _join_workers(helpers)
        if pool is not None:
            pool.close()
            shutil.rmtree(pool.cache_dir, ignore_errors=True)
            if pool.stats["queued"]:
                notes.append(pool.summary())
    if args.worker:
        print(f"worker {os.getpid()}: measured {result.measured} ({result.failed} failed), reused {result.reused}")
        return 0
    result.plan.save(args.output)
    fronts = _save_front(result, args.output)
    study.set_user_attr("best_plan", result.plan.to_json())
    study.set_user_attr("finished", time.time())
    if result.refine_study:
        study.set_user_attr("refine_study", result.refine_study)
    print(summarise(result, model))
    for line in notes + fronts:
        print(line)
    if args.cost_model and not args.worker:
        print(_update_cost_model(args.cost_model, cost_model, result, model))
    print(f"plan written to {args.output}; study '{study.study_name}' in {args.storage}")
    print(f"deploy it: partune export --study '{study.study_name}' --storage {args.storage} -o DIR")
    return 0


def _build_pool(args: argparse.Namespace, timeout_s: float):
    """(a build pool, the measuring worker's cores), or (None, None) where none pays.

    A pool builds candidates on the cores the timings do not use (``partune.runners.build_pool``).
    It needs a local runner and a core to spare, and is left out when several workers share
    the search (they already keep every core busy).
    """
    import tempfile

    from partune.runners.build_pool import BuildPool, split_cores, unpin_search_process

    if args.build_pool == "off" or args.runner != "local" or args.workers > 1 or args.worker:
        return None, None
    measure_cpus, build_cpus = split_cores(args.threads)
    if not build_cpus:
        return None, None
    unpin_search_process()
    cache = tempfile.mkdtemp(prefix="partune-builds-")
    return BuildPool(cache, workers=1, threads=args.threads, cpus=build_cpus, timeout_s=timeout_s), measure_cpus


def _job_started(study, args: argparse.Namespace) -> None:
    """What `partune status` shows of a running job: its model, budget and deadline."""
    import time

    study.set_user_attr("model", os.path.abspath(args.model) if os.path.exists(args.model) else args.model)
    if args.input_shape:
        study.set_user_attr("input_shape", args.input_shape)
    study.set_user_attr("started", time.time())
    study.set_user_attr("n_trials", args.refine_trials)
    study.set_user_attr("objective", args.objective)
    study.set_user_attr("deadline", time.time() + parse_duration(args.timeout) if args.timeout else None)
    study.set_user_attr("finished", None)
    study.set_user_attr("stopped", None)


def _start_workers(args: argparse.Namespace) -> list:
    """``--workers N``: N-1 more processes running this same command as helpers."""
    import subprocess
    import tempfile

    argv, skip = [], False
    for a in args.argv:
        if skip:
            skip = False
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            argv.append(a)
    helpers = []
    for _ in range(args.workers - 1):
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", "partune.cli", *argv, "--worker"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        helpers.append((proc, log))
    return helpers


def _join_workers(helpers: list) -> list[str]:
    """Wait for the helper workers; one line each on how they ended."""
    lines = []
    for proc, log in helpers:
        code = proc.wait()
        log.seek(0)
        tail = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        lines.append(tail[-1] if code == 0 and tail else f"worker {proc.pid} ended with exit code {code}: "
                     + (tail[-1] if tail else "no output"))
    return lines


def _save_front(result, output: str) -> list[str]:
    """The latency/memory Pareto front, one plan file each (PLAN.front1.json is the fastest)."""
    if not result.front:
        return []
    stem = output[:-5] if output.endswith(".json") else output
    lines = ["", "Pareto front of the refinement (latency vs peak memory; each variant in a fresh process):",
             f"| {'plan file':<30} | {'best ms':>9} | {'peak MiB':>9} | backends |", "|" + "-" * 32 + "|" +
             "-" * 11 + "|" + "-" * 11 + "|----------|"]
    for i, (plan, m) in enumerate(result.front, 1):
        path = f"{stem}.front{i}.json"
        plan.save(path)
        mib = f"{m.peak_bytes / 2**20:9.1f}" if m.peak_bytes is not None else f"{'-':>9}"
        lines.append(f"| {path[-30:]:<30} | {m.cost_s * 1e3:9.3f} | {mib} | {'+'.join(plan.backends)} |")
    return lines


def cmd_export(args: argparse.Namespace) -> int:
    """A deploy directory from a plan file, or from the best plan a tuning study stored."""
    from partune.core.errors import PartuneError
    from partune.core.plan import Plan
    from partune.export import export

    spec, shapes = args.model, args.input_shape
    if args.plan:
        if not spec:
            raise PartuneError("export --plan needs the MODEL the plan was made for")
        plan = Plan.load(args.plan)
    else:
        if not args.study:
            raise PartuneError("export needs --plan FILE, or --study NAME (and --storage) of a tuning job")
        attrs = _job(args.storage, args.study)
        plan = Plan.from_json(attrs["best_plan"])
        spec = spec or attrs.get("model")
        shapes = shapes or attrs.get("input_shape")
    args.model, args.input_shape = spec, shapes
    model = load_model(args)
    if plan.fingerprint != model.graph.fingerprint:
        raise PartuneError(f"the plan was made for another model (fingerprint {plan.fingerprint}, "
                           f"{model.name} is {model.graph.fingerprint})")
    try:
        out = export(model, plan, args.output, args.threads)
    except FileExistsError as e:
        raise PartuneError(str(e)) from None
    print(f"exported {model.name} under its plan ({', '.join(plan.backends)}) to {out}/")
    print(f"run it:  partune run {out}    or in Python: partune.deployed.load('{out}')(*inputs)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Every tuning job in a storage: progress, time left, emitted plan and its standing."""
    import time

    from partune.store.measurements import STUDY_PREFIX

    summaries = _study_summaries(args.storage)
    stores = [s for s in summaries if s.study_name.startswith(STUDY_PREFIX)]
    trials = {s.study_name: s.n_trials for s in summaries}
    jobs = [s for s in summaries if "best_plan" in s.user_attrs or "started" in s.user_attrs]
    print(f"{args.storage}: {sum(s.n_trials for s in stores)} measurements on {len(stores)} device(s), "
          f"{len(jobs)} tuning job(s)")
    if not jobs:
        return 0
    print(f"| {'study':<40} | {'state':<16} | {'refined':>7} | {'emitted plan':<22} | {'backends':<24} | "
          f"{'ms':>8} | {'x best peer':>11} |")
    print("|" + "|".join("-" * w for w in (42, 18, 9, 24, 26, 10, 13)) + "|")
    now = time.time()
    for s in sorted(jobs, key=lambda s: s.datetime_start or 0):
        attrs = s.user_attrs
        if attrs.get("finished") or "started" not in attrs:
            state = "done"
        elif (attrs.get("stopped") or 0) > attrs["started"]:
            state = "stopped (resumable)"
        elif attrs.get("deadline"):
            left = attrs["deadline"] - now
            state = f"running, {_duration(left)} left" if left > 0 else "running, overtime"
        else:
            state = f"running {_duration(now - attrs['started'])}"
        refined = (f"{trials.get(attrs['refine_study'], 0)}/{attrs.get('n_trials', '?')}"
                   if attrs.get("refine_study") else "-")
        plan = attrs.get("best_plan")
        if plan is None:
            print(f"| {s.study_name[:40]:<40} | {state[:16]:<16} | {refined:>7} | {'(none yet)':<22} | "
                  f"{'-':<24} | {'-':>8} | {'-':>11} |")
            continue
        notes = plan.get("notes", {})
        backends = "+".join(sorted({r["scope"]["backend"] for r in plan["regions"]}))
        ms = notes.get("verdict_median_s", {}).get(notes.get("chosen_as"), notes.get("measured_s", float("nan")))
        x = notes.get("speedup_vs_best_peer")
        print(f"| {s.study_name[:40]:<40} | {state[:16]:<16} | {refined:>7} | "
              f"{str(notes.get('chosen_as', '?'))[:22]:<22} | {backends[:24]:<24} | "
              f"{ms * 1e3:8.3f} | {(f'{x:.2f}x' if x else '-'):>11} |")
    return 0


def _duration(seconds: float) -> str:
    """3h12m, 4m05s, 12s: for people."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown and PNG plots for one tuning job."""
    from partune.core.errors import PartuneError
    from partune.core.plan import Plan
    from partune.report import write_report

    attrs = _job(args.storage, args.study)
    model = None
    if attrs.get("model"):
        args.model, args.input_shape = attrs["model"], attrs.get("input_shape")
        try:
            model = load_model(args)
        except PartuneError as e:  # the report still has its tables and plots without the graph
            print(f"partune: note: no graph picture ({e})", file=sys.stderr)
    path = write_report(args.storage, args.study, Plan.from_json(attrs["best_plan"]), Path(args.output), model,
                        attrs.get("refine_study"))
    print(f"report written to {path} (with {', '.join(sorted(p.name for p in path.parent.glob('*.png')))})")
    return 0


def cmd_costmodel_eval(args: argparse.Namespace) -> int:
    """Leave-one-model-out: how well the cost model ranks each DP frontier's candidates."""
    from partune.core.errors import PartuneError
    from partune.cost_models.xgboost_model import CostModel
    from partune.models import load
    from partune.search.cost_model_eval import Samples, leave_one_model_out, samples_for
    from partune.store.measurements import STUDY_PREFIX, MeasurementStore

    stores = [s for s in _study_summaries(args.storage) if s.study_name.startswith(STUDY_PREFIX)]
    if not stores:
        raise PartuneError(f"{args.storage} holds no measurements (run `partune tune` first)")
    device = args.device or max(stores, key=lambda s: s.n_trials).study_name[len(STUDY_PREFIX):]
    store = MeasurementStore(args.storage, device)
    labels = {t.user_attrs.get("label", "").split(" ")[0] for t in store.study.get_trials(deepcopy=False)}
    specs = args.models.split(",") if args.models else sorted(n for n in labels if _is_zoo(n))
    backends = [b.strip() for b in args.backends.split(",")]
    data: list[Samples] = []
    for spec in specs:
        s = samples_for(load(spec), store, backends, args.threads)
        print(f"{spec}: {len(s.seconds)} measured candidates", file=sys.stderr)
        if len(s.seconds):
            data.append(s)
    if len(data) < 2:
        raise PartuneError("leave-one-model-out needs measurements of at least two models "
                           f"(found {len(data)}; name them with --models)")
    scores = leave_one_model_out(data)
    print(f"device {device}; {sum(len(s.seconds) for s in data)} measurements of {len(data)} models; "
          "each model held out, the XGBoost model trained on the others")
    print(f"| {'held-out model':<22} | {'candidates':>10} | {'frontiers':>9} | {'Spearman':>8} | {'top-1':>6} | {'top-3':>6} |")
    print("|" + "|".join("-" * w for w in (24, 12, 11, 10, 8, 8)) + "|")
    for sc in scores:
        print(f"| {sc.model:<22} | {sc.samples:>10} | {sc.frontiers:>9} | {sc.spearman:8.3f} | "
              f"{sc.top1:6.1%} | {sc.top3:6.1%} |")
    rho, top1, top3 = (sum(getattr(s, f) for s in scores) / len(scores) for f in ("spearman", "top1", "top3"))
    print(f"| {'mean':<22} | {'':>10} | {'':>9} | {rho:8.3f} | {top1:6.1%} | {top3:6.1%} |")
    if args.save:
        import numpy as np

        model = CostModel().fit(np.concatenate([s.x for s in data]), np.concatenate([s.seconds for s in data]))
        model.save(args.save)
        print(f"cost model trained on all {model.trained_on} measurements saved to {args.save}")
    return 0


def _is_zoo(name: str) -> bool:
    from partune.zoo import ZOO

    return name in ZOO


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from partune.runners.rpc import serve

    serve(args.tracker, args.key, host=args.host, port=args.port, port_end=args.port_end)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from partune.zoo import ZOO

    for name in sorted(ZOO):
        print(f"{name:<22} {ZOO[name].family:<12} {ZOO[name].description}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from partune.backends import registry

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
    p.add_argument("--input-shape", action="append", metavar="NAME=D1,D2,...",
                   help="static shape for an ONNX input whose dimensions are symbolic, e.g. "
                        "input_ids=1,128 (repeatable; open dimensions default to 1)")
    p.add_argument("--tvm-database", metavar="DIR",
                   help="a MetaSchedule JSON database: the tvm backend applies its tuned schedules")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a model under a plan, or a deploy directory; print latency and error")
    r.add_argument("model", metavar="MODEL", help="a model (zoo name or file), or a directory from `partune export`")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a plan JSON file (from `partune tune` or --save-plan)")
    g.add_argument("--backend", default="tvm",
                   help="single-backend plan: all this backend accepts, the rest to tvm (default tvm)")
    r.add_argument("--save-plan", metavar="FILE", help="write the plan that was run as JSON")
    r.add_argument("--input", action="append", metavar="X.npy",
                   help="for a deploy directory: an input array (repeat per input; default: the example inputs)")
    r.add_argument("--output", metavar="PREFIX", help="for a deploy directory: save outputs as PREFIX_i.npy")
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="time each single-backend plan and the usual peers in one run")
    b.add_argument("model", metavar="MODEL")
    b.add_argument("--backends", help="comma-separated backends for single-backend plans (default: all)")
    b.add_argument("--peers", help="comma-separated peers: torch,torch.compile,onnxruntime,openvino (default: all)")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="search the fastest partitioning (Collage DP on measured candidates)",
                       description="Enumerate candidate regions per backend, measure each once on the values "
                       "it sees inside the model (stored in Optuna storage and reused by every later "
                       "run), pick the cheapest cover by DP, measure it and every single-backend plan "
                       "end to end, learn border costs and let the DP propose again, refine with "
                       "Optuna, then time the finalists against onnxruntime on your model and "
                       "torch.compile in one process and write the fastest plan, saying how it "
                       "stands. Interrupt and rerun to resume.")
    t.add_argument("model", metavar="MODEL")
    t.add_argument("--backends", default="tvm,torch,onnxruntime,openvino",
                   help="comma-separated backends on offer (default tvm,torch,onnxruntime,openvino)")
    t.add_argument("--storage", default="sqlite:///partune.db",
                   help="Optuna storage URL for measurements (default sqlite:///partune.db; "
                        "postgresql://... for many workers)")
    t.add_argument("--study", help="name of this tuning job in the storage (default MODEL:BACKENDS)")
    t.add_argument("--runner", default="local", help="local, or rpc://HOST:PORT/KEY for a TVM RPC tracker")
    t.add_argument("--timeout", help="time budget of the search (e.g. 30m, 8h): candidate measuring and "
                   "refinement stop when it is spent, then the best plan so far meets the peers and is written")
    t.add_argument("--measure-timeout", default="120s",
                   help="limit for one measurement; a hang costs that candidate (default 120s)")
    t.add_argument("--pin", action="append", metavar="SELECTOR=BACKEND",
                   help="keep nodes on a backend: a node index, a range a-b, or an op name (repeatable)")
    t.add_argument("--n-trials", "--refine-trials", dest="refine_trials", type=int, default=8, metavar="N",
                   help="after the DP: the refinement study holds N plan variants (move a region to "
                        "another backend, merge neighbours), proposed by Optuna and measured end to end; "
                        "resumable, shared by all workers; raise it for overnight jobs; 0 to skip (default 8)")
    t.add_argument("--objective", choices=("latency", "latency+memory"), default="latency",
                   help="what refinement minimises: latency (TPE), or latency and peak memory "
                        "(NSGA-II; each variant measured in a fresh process; the Pareto front is "
                        "reported and written as PLAN.frontN.json)")
    t.add_argument("--build-pool", choices=("auto", "off"), default="auto",
                   help="auto: with the local runner and a core to spare, candidates are built ahead "
                        "of their timing on the other cores while the measurements keep a core of "
                        "their own (about 1.2-1.3x faster candidate measuring on 2 cores); off: the "
                        "measuring worker builds each candidate itself (default auto)")
    t.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N processes share this search (claimed measurements, one Optuna study): "
                        "worth it with an RPC runner or many cores; on a small machine parallel "
                        "timing is noisy (default 1). Separate `partune tune` runs on one --storage "
                        "share the work the same way")
    t.add_argument("--heartbeat", type=int, default=60, metavar="S",
                   help="refinement trials beat every S seconds; a trial silent for 2S (a killed "
                        "worker) is failed and retried (default 60)")
    t.add_argument("--retry-failed", action="store_true",
                   help="measure again, once, what the store holds as failed (after fixing a backend, "
                        "or when the failure was the machine's); by default a failure is final")
    t.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a helper started by --workers
    t.add_argument("--tune-budget", metavar="DURATION",
                   help="auto-tune TVM regions with MetaSchedule for this long in all (e.g. 20m), most "
                        "expected gain first (regions whose untuned TVM time, divided by what tuning "
                        "usually buys, would beat the best other backend); adds the tvm-tuned backend. "
                        "Records persist beside the storage (PLAN_DB.tuning/) and serve every later run")
    t.add_argument("--tune-trials", type=int, default=32, metavar="N",
                   help="MetaSchedule trials per tuned region (default 32)")
    t.add_argument("--cost-model", metavar="FILE|auto",
                   help="an XGBoost cost model (see `partune costmodel eval --save`), or 'auto' for the "
                        "one kept beside the storage: measure only the 3 most promising candidates per "
                        "DP frontier plus 10%% at random, learn from them, and let the DP use "
                        "predictions for the rest (it measures any it picks). The model learns this "
                        "run's measurements and is saved (created if missing: the next model's search "
                        "starts from everything measured before)")
    t.add_argument("--peers", default="onnxruntime,openvino,torch.compile",
                   help="the tools you would use instead, timed against the finalist plans in one "
                        "process, interleaved: onnxruntime and openvino (f32, latency, same threads) on "
                        "your ONNX file (or a torch.onnx.export, or the Relax module's ONNX translation), "
                        "torch.compile, torch; 'none' to skip. When a library on your file beats every "
                        "partitioned plan, that is the plan emitted (default onnxruntime,openvino,torch.compile)")
    t.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser("export", help="write a deploy directory: compiled model, plan, manifest",
                       description="Compile MODEL under a plan (--plan FILE, or the best plan of a tuning "
                       "study) into a directory that `partune run DIR` or partune.deployed.load(DIR) runs "
                       "with no search code. Files are checksummed; a changed file or a different "
                       "environment is refused at load time.")
    e.add_argument("model", metavar="MODEL", nargs="?", help="the model (default: the one the study tuned)")
    e.add_argument("--plan", help="a plan JSON file")
    e.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage of the study")
    e.add_argument("--study", help="the tuning job whose best plan to export (see `partune tune --study`)")
    e.add_argument("-o", "--output", required=True, metavar="DIR", help="the deploy directory to write")
    e.set_defaults(func=cmd_export)

    rp = sub.add_parser("report", help="write a Markdown report with plots for one tuning job")
    rp.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage of the study")
    rp.add_argument("--study", required=True, help="the tuning job (see `partune status`)")
    rp.add_argument("-o", "--output", required=True, metavar="DIR", help="where report.md and the PNGs go")
    rp.set_defaults(func=cmd_report)

    cm = sub.add_parser("costmodel", help="the XGBoost cost model learned from the measurement store")
    cms = cm.add_subparsers(dest="action", required=True)
    ev = cms.add_parser("eval", help="leave-one-model-out Spearman and top-1/top-3 recall per DP frontier",
                        description="For each model measured in the store, train the cost model on the "
                        "other models' measurements and score how it ranks the candidates of each DP "
                        "frontier (the candidates starting at one node) of the held-out model.")
    ev.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage of the measurements")
    ev.add_argument("--models", help="comma-separated models (zoo names or files) to evaluate on "
                    "(default: every zoo model measured in the store)")
    ev.add_argument("--backends", default="tvm,torch,onnxruntime,openvino", help="backends the searches offered")
    ev.add_argument("--device", help="device fingerprint of the measurements (default: the one with most)")
    ev.add_argument("--save", metavar="FILE", help="also train on everything and save the model (XGBoost JSON)")
    ev.set_defaults(func=cmd_costmodel_eval)

    st = sub.add_parser("status", help="list the tuning jobs in a storage and how their plans stand")
    st.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage URL (default sqlite:///partune.db)")
    st.set_defaults(func=cmd_status)

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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `tune --workers N` starts helpers with the same command
    if args.threads < 1:
        print("partune: error: --threads must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.tvm_database:
        if not os.path.isdir(args.tvm_database):
            print(f"partune: error: --tvm-database {args.tvm_database} is not a directory", file=sys.stderr)
            return EXIT_USAGE
        os.environ["PARTUNE_TVM_DATABASE"] = os.path.abspath(args.tvm_database)
    _setup_threads(args.threads)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("partune: interrupted (measurements taken so far are kept; rerun to resume)", file=sys.stderr)
        return 130
    except Exception as e:
        if _is_bad_input(e):
            print(f"partune: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("PARTUNE_DEBUG"):  # a bug, not bad input: still one line, unless asked
            raise
        last = (str(e).strip().splitlines() or [""])[-1][:300]
        print(f"partune: internal error: {type(e).__name__}: {last} (PARTUNE_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


def _is_bad_input(e: Exception) -> bool:
    """Errors that mean bad input (each carries a one-line message), not a bug."""
    from partune.backends.model_file import ModelFileError
    from partune.backends.registry import UnknownBackendError
    from partune.core.errors import PartuneError
    from partune.deployed import DeployError

    return isinstance(e, (PartuneError, UnknownBackendError, DeployError, ModelFileError))


if __name__ == "__main__":
    sys.exit(main())
