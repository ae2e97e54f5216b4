"""``partune tune``: a tuning job, its helper workers, its build pool, its progress bars and its
outputs."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import asdict, dataclass, replace

from partune.commands.common import (
    beside_store,
    load_model,
    make_runner,
    parse_duration,
    parse_pins,
    previous_plan,
    read_samples,
    sqlite_file,
)
from partune.commands.summary import summarise
from partune.search import Budget

DEFAULT_TUNE_BUDGET_S = 600.0  # when tvm-tuned is named without --tune-budget or --timeout
DEFAULT_REFINE_TRIALS = 8  # without --timeout; with one, refinement runs until it converges


def cmd_tune(args: argparse.Namespace) -> int:
    """A tuning job: read what to search, run the search (with helpers and a build pool), write the
    plan."""
    import time

    args.shape_label = getattr(args, "shape_label", None)
    if getattr(args, "shapes", None) is not None and args.shape_label is None:
        from partune.commands.tune_shapes import cmd_tune_shapes

        return cmd_tune_shapes(args, cmd_tune)  # each point of --shapes comes back here
    started = time.monotonic()
    from partune.search import Progress, tune

    job = _prepare(args)
    helpers = _start_workers(args, job.study.study_name) if args.workers > 1 else []
    bars = _Bars(started) if not args.worker else None
    pool, measure_cpus = _build_pool(args, job.measure_timeout)
    runner = make_runner(args.runner, job.measure_timeout, args.threads, measure_cpus)
    progress = None
    if bars:
        beat = _StatusBeat(job.study, runner, pool)
        progress = Progress(
            lambda name, total: (bars.start_phase(name, total), beat.start_phase(name)),
            lambda status: (bars.advance(status), beat.tick()),
        )
    try:
        result = tune(
            job.model,
            job.backends,
            runner,
            job.store,
            threads=args.threads,
            pins=job.pins,
            deadline=job.budget.until if job.budget else None,
            budget=job.budget,
            progress=progress,
            peers=job.peers,
            refine_trials=args.refine_trials,
            previous=job.previous,
            cost_model=job.cost_model,
            memory=args.objective == "latency+memory",
            worker_only=args.worker,
            tune_budget_s=job.tune_budget,
            tune_trials=args.tune_trials,
            build_pool=pool,
            precision=args.precision,
            tolerance=args.tolerance if args.precision != "f32" else None,
            calibration=job.data.calibration,
            validation=job.data.validation,
            metric=args.metric,
            one_thread_regions=args.fewer_threads == "on",
        )
    except KeyboardInterrupt:
        if not args.worker:
            job.study.set_user_attr("stopped", time.time())
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
    if bars:
        notes.append(bars.timeline())
    from partune.search import MemoryPeaks

    result.memory = MemoryPeaks.of(runner, pool)  # the workers' peaks, kept past their close
    return _finish(args, job, result, notes)


@dataclass
class _Job:
    """What the command line asked a tuning job to search, read and checked."""

    model: object
    backends: list[str]
    tune_budget: float
    budget: Budget | None
    pins: dict
    measure_timeout: float
    store: object
    study: object
    peers: tuple[str, ...]
    previous: object
    cost_model: object
    data: AccuracyData


def _prepare(args: argparse.Namespace) -> _Job:
    """Backends, budgets, pins, the store and the study: every bad input refused before any work."""

    import optuna

    from partune.backends import registry
    from partune.core import PartuneError
    from partune.runners import PEER_LABELS
    from partune.store import MeasurementStore

    budget = (
        Budget.of(parse_duration(args.timeout)) if args.timeout else None
    )  # counts the import too
    backends, named, tune_budget = _backends(args, budget)
    _check_precision(args, backends)
    if args.refine_trials is None:  # with a budget: until refinement converges (None)
        args.refine_trials = None if budget is not None else DEFAULT_REFINE_TRIALS
    model = load_model(args)
    data = _accuracy_data(args, model)
    pins = dict(model.pins)
    for node, scope in parse_pins(args.pin, model).items():
        joined = pins[node].join(scope) if node in pins else scope
        if joined is None:
            raise PartuneError(
                f"--pin puts node {node} on {scope.backend}, "
                f"the model pins it to {pins[node].backend or f'device {pins[node].device_type}'}"
            )
        pins[node] = joined
    if args.workers < 1 or args.heartbeat < 1:
        raise PartuneError("--workers and --heartbeat must be at least 1")
    measure_timeout = parse_duration(args.measure_timeout)
    # The device measured on decides which measurements hold: a remote one's own fingerprint.
    device = getattr(args, "probed_device", None)  # a bucket of --shapes after the first
    if device is None:
        with make_runner(args.runner, measure_timeout, args.threads) as probe:
            device = args.probed_device = probe.device()
    store = MeasurementStore(
        args.storage,
        device,
        claim_ttl_s=max(1800.0, 3 * measure_timeout),
        heartbeat_s=args.heartbeat,
        retry_failed=args.retry_failed,
    )
    study_name = args.study or _study_name(args, model.name, named)
    if getattr(args, "shape_label", None):  # one bucket of --shapes: a study each
        study_name += f":{args.shape_label}"
    peers = tuple(p for p in args.peers.split(",") if p and p != "none")
    if unknown := [p for p in peers if p not in PEER_LABELS]:
        raise PartuneError(
            f"unknown peer(s) {', '.join(unknown)}: use {', '.join(PEER_LABELS)} or none"
        )
    study = optuna.create_study(study_name=study_name, storage=store.storage, load_if_exists=True)
    if not args.worker:
        _job_started(study, args)
    from partune.cost_models import FileKeptModel

    auto = args.cost_model == "auto"
    if args.cost_model == "off" or (auto and args.storage in ("memory", "sqlite:///:memory:")):
        args.cost_model = None
    elif auto and sqlite_file(args.storage):
        args.cost_model = FileKeptModel(beside_store(args.storage, ".costmodel.json"))
    elif auto:  # a shared (PostgreSQL) store has no "beside": its workers share the one kept in it
        from partune.cost_models import StorageKeptModel
        from partune.store import shown

        args.cost_model = StorageKeptModel(store.storage, shown(args.storage))
    else:
        args.cost_model = FileKeptModel(args.cost_model)
    previous = previous_plan(store.storage, study_name)
    if previous is not None:  # its tuned regions are built from the records beside the store
        backends += [
            b for b in previous.backends if b not in backends and registry.get(b).autotuned
        ]
    if (
        any(registry.get(b).autotuned for b in backends)
        and registry.settings().tuning_database is None
    ):
        # Beside the store: tuning records serve every later run and model, like measurements.
        database = os.path.abspath(beside_store(args.storage, ".tuning"))
        registry.configure(replace(registry.settings(), tuning_database=database))
    return _Job(
        model,
        backends,
        tune_budget,
        budget,
        pins,
        measure_timeout,
        store,
        study,
        peers,
        previous,
        _load_cost_model(args.cost_model, required=not auto),
        data,
    )


def _backends(
    args: argparse.Namespace, budget: Budget | None
) -> tuple[list[str], list[str], float]:
    """The backends on offer; those that name the job's study; seconds of tuning (0: none, or
    the budget's share).

    ``--tune-budget`` adds the autotuned backends (tvm-tuned) to the study's name, as naming
    them does. A budget long enough to tune adds them to the offer only: the study keeps its
    name, so a shorter budget's plan competes again in a longer budget's verdict.
    """
    from partune.backends import registry

    named = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in named:
        registry.get(b)
    autotuned = [n for n in registry.names() if registry.get(n).autotuned]
    tune_budget = parse_duration(args.tune_budget) if args.tune_budget else 0.0
    if tune_budget > 0:
        named += [n for n in autotuned if n not in named]
    offered = list(named)
    if budget is not None and budget.tunes and "tvm" in named and args.tune_budget is None:
        offered += [n for n in autotuned if n not in offered]
    if budget is None and tune_budget == 0 and any(b in autotuned for b in named):
        tune_budget = DEFAULT_TUNE_BUDGET_S
    return offered, named, tune_budget


def _study_name(args: argparse.Namespace, model: str, backends: list[str]) -> str:
    """The job's default name: the model and backends, and what changes its plans' meaning (an
    f32 job never resumes a bf16 or int8 plan)."""
    reduced = ""
    if args.precision != "f32":
        metric = "" if args.metric == "rel" else f":{args.metric}"
        reduced = f":{args.precision}<={args.tolerance:g}{metric}"
    threads = ":same-threads" if args.fewer_threads == "off" and args.threads > 1 else ""
    return f"{model}:{','.join(backends)}{reduced}{threads}"


@dataclass(frozen=True)
class AccuracyData:
    """What reduced precision is calibrated and judged on, and a line saying so."""

    calibration: tuple = ()
    validation: tuple = ()
    note: str = ""


def _accuracy_data(args: argparse.Namespace, model) -> AccuracyData:
    """The user's samples (``--calibration``, ``--validation``), read and checked against the
    model before anything is measured; none without reduced precision."""
    from partune.core import PartuneError
    from partune.runners import check_metric_fits

    if args.precision == "f32":
        if args.calibration or args.validation or args.metric != "rel":
            raise PartuneError(
                "--calibration, --validation and --metric need --precision bf16|int8"
            )
        return AccuracyData()
    check_metric_fits(args.metric, model.reference)
    if not args.calibration:
        if args.validation:
            raise PartuneError("--validation needs --calibration (the samples to calibrate on)")
        return AccuracyData(
            note="accuracy judged on synthetic data (the model's inputs and draws like them): "
            "give --calibration for your own"
        )
    calibration, validation, note = read_samples(args.calibration, args.validation, model)
    return AccuracyData(calibration, validation, f"accuracy by {args.metric}: {note}")


def _check_precision(args: argparse.Namespace, backends: list[str]) -> None:
    """bf16 only where it is real: a CPU with bf16 instructions, a backend with a bf16 path;
    int8 where a backend runs it."""
    from partune.backends import registry
    from partune.core import PartuneError

    if args.precision == "int8":
        if not registry.int8_names(backends):
            offering = [n for n in registry.default_names() if registry.get(n).int8]
            raise PartuneError(
                f"--precision int8: none of {', '.join(backends)} runs int8 "
                f"(add {' or '.join(offering)} to --backends)"
            )
    if args.precision == "f32":
        return
    if not args.tolerance > 0:
        raise PartuneError(f"--tolerance must be a relative error above 0, not {args.tolerance:g}")
    if args.precision != "bf16":
        return
    if not registry.cpu_has_bf16():
        raise PartuneError(
            "--precision bf16 is not offered here: this CPU reports no bf16 instructions "
            "(avx512_bf16 or amx_bf16), so bf16 would be emulated, not faster"
        )
    if not registry.bf16_names(backends):
        offering = [n for n in registry.default_names() if registry.get(n).bf16]
        raise PartuneError(
            f"--precision bf16: none of {', '.join(backends)} has a bf16 path "
            f"(add {' or '.join(offering)} to --backends)"
        )


def _finish(args: argparse.Namespace, job: _Job, result, notes: list[str]) -> int:
    """The plan written, the study told, the summary printed (a helper worker prints one line)."""
    import time

    counts = result.counts
    if args.worker:
        print(
            f"worker {os.getpid()}: measured {counts.measured} ({counts.failed} failed), reused "
            f"{counts.reused}"
        )
        return 0
    result.plan.save(args.output)
    fronts = _save_front(result, args.output)
    study = job.study
    study.set_user_attr("best_plan", result.plan.to_json())
    study.set_user_attr("memory", asdict(result.memory))
    study.set_user_attr("finished", time.time())
    if result.refine_study:
        study.set_user_attr("refine_study", result.refine_study)
    print(summarise(result, job.model))
    if job.data.note:
        print(job.data.note)
    for line in notes + fronts:
        print(line)
    if args.cost_model:
        print(_update_cost_model(args.cost_model, job.cost_model, result, job.model))
    if args.shape_label is None:  # a bucket's plan goes into the job's file
        print(f"plan written to {args.output}; study '{study.study_name}' in {args.storage}")
        print(
            f"deploy it: partune export --study '{study.study_name}' --storage {args.storage} "
            "-o DIR"
        )
    return 0


def _build_pool(args: argparse.Namespace, timeout_s: float):
    """(a build pool, the measuring worker's cores), or (None, None) where none pays.

    A pool builds candidates on the cores the timings do not use (``partune.runners.build_pool``).
    It needs a local runner and a core to spare, and is left out when several workers share
    the search (they already keep every core busy).
    """
    import tempfile

    from partune.runners import BuildPool, split_cores, unpin_search_process

    if args.build_pool == "off" or args.runner != "local" or args.workers > 1 or args.worker:
        return None, None
    measure_cpus, build_cpus = split_cores(args.threads)
    if not build_cpus:
        return None, None
    unpin_search_process()
    cache = tempfile.mkdtemp(prefix="partune-builds-")
    return BuildPool(
        cache, workers=1, threads=args.threads, cpus=build_cpus, timeout_s=timeout_s
    ), measure_cpus


def _job_started(study, args: argparse.Namespace) -> None:
    """What `partune status` shows of a running job: its model, budget and deadline."""
    import time

    study.set_user_attr(
        "model", os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    )
    if args.input_shape:
        study.set_user_attr("input_shape", args.input_shape)
    if getattr(args, "disable_pass", None):  # export and explain rebuild the module the plan is for
        study.set_user_attr("disabled_passes", args.disable_pass)
    for samples in ("calibration", "validation"):  # export quantizes a peer's file again on them
        if getattr(args, samples, None):
            study.set_user_attr(samples, os.path.abspath(getattr(args, samples)))
    study.set_user_attr("started", time.time())
    study.set_user_attr("n_trials", args.refine_trials)
    study.set_user_attr("objective", args.objective)
    study.set_user_attr(
        "deadline", time.time() + parse_duration(args.timeout) if args.timeout else None
    )
    study.set_user_attr("finished", None)
    study.set_user_attr("stopped", None)


def _helper_argv(args: argparse.Namespace, study: str) -> list[str]:
    """The command line a helper worker runs: this one without ``--workers``; for one bucket
    of ``--shapes``, that bucket alone (its shapes, its study)."""
    drop = {"--workers"} | ({"--shapes", "--pad-safe"} if args.shape_label else set())
    argv, skip = [], False
    for a in args.argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=")[0] not in drop:
            argv.append(a)
    if args.shape_label:  # global flags go before the subcommand
        at = argv.index("tune")
        argv[at:at] = [f"--input-shape={s}" for s in args.input_shape]
        argv += ["--study", study]
    return argv


def _start_workers(args: argparse.Namespace, study: str) -> list:
    """``--workers N``: N-1 more processes running this same command as helpers."""
    import subprocess
    import tempfile

    argv = _helper_argv(args, study)
    helpers = []
    for _ in range(args.workers - 1):
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "partune.cli", *argv, "--worker"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        helpers.append((proc, log))
    return helpers


def _join_workers(helpers: list) -> list[str]:
    """Wait for the helper workers; one line each on how they ended."""
    lines = []
    for proc, log in helpers:
        code = proc.wait()
        log.seek(0)
        tail = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        lines.append(
            tail[-1]
            if code == 0 and tail
            else f"worker {proc.pid} ended with exit code {code}: "
            + (tail[-1] if tail else "no output")
        )
    return lines


def _save_front(result, output: str) -> list[str]:
    """The latency/memory Pareto front, one plan file each (PLAN.front1.json is the fastest)."""
    if not result.front:
        return []
    stem = output[:-5] if output.endswith(".json") else output
    lines = [
        "",
        "Pareto front of the refinement (latency vs peak memory; each variant in a fresh process):",
        f"| {'plan file':<30} | {'best ms':>9} | {'peak MiB':>9} | backends |",
        "|" + "-" * 32 + "|" + "-" * 11 + "|" + "-" * 11 + "|----------|",
    ]
    for i, (plan, m) in enumerate(result.front, 1):
        path = f"{stem}.front{i}.json"
        plan.save(path)
        mib = f"{m.peak_bytes / 2**20:9.1f}" if m.peak_bytes is not None else f"{'-':>9}"
        lines.append(
            f"| {path[-30:]:<30} | {m.cost_s * 1e3:9.3f} | {mib} | {'+'.join(plan.backends)} |"
        )
    return lines


class _StatusBeat:
    """What `partune status` shows of a running job: its phase and the peak resident size of
    each of its processes so far, written to the job's study at most every ``every_s``."""

    def __init__(self, study, runner, pool, every_s: float = 30.0) -> None:
        self.study, self.runner, self.pool, self.every_s = study, runner, pool, every_s
        self.phase, self.last = "", float("-inf")

    def start_phase(self, name: str) -> None:
        self.phase, self.last = name, float("-inf")  # a new phase is shown at once
        self.tick()

    def tick(self) -> None:
        import time

        from partune.search import MemoryPeaks

        if time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        try:
            self.study.set_user_attr("running", {"phase": self.phase, "at": time.time()})
            self.study.set_user_attr("memory", asdict(MemoryPeaks.of(self.runner, self.pool)))
        except Exception:  # noqa: BLE001 - a status line must never stop the search (storage down)
            pass


class _Bars:
    """tqdm progress bars, one per phase of the search, and the wall time each phase took."""

    def __init__(self, started: float) -> None:
        """``started``: when the command began (``time.monotonic``): start-up is timed from it."""
        self.bar = None
        self.spent: dict[str, float] = {}  # phase -> seconds, a phase started again adding up
        self.phase: str | None = "start-up (imports, model, store)"
        self.since = started

    def start_phase(self, name: str, total: int) -> None:
        from tqdm import tqdm

        self._clock(name)
        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(
            total=total or None, desc=name, unit="run", file=sys.stderr, dynamic_ncols=True
        )

    def advance(self, status: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(status[:60], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._clock(None)

    def _clock(self, phase: str | None) -> None:
        import time

        now = time.monotonic()
        if self.phase is not None:
            self.spent[self.phase] = self.spent.get(self.phase, 0.0) + now - self.since
        self.phase, self.since = phase, now

    def timeline(self) -> str:
        """Where this job's wall time went, one entry per phase, in the order first started."""
        return "time by phase: " + "; ".join(f"{name} {s:.1f} s" for name, s in self.spent.items())


def _load_cost_model(kept, required: bool = True):
    """The cost model where ``kept`` keeps it (a ``FileKeptModel`` or a ``StorageKeptModel``; None
    when there is none yet: this run trains it). One that cannot be used is an error when the
    user named it; the default one (``auto``) is replaced instead, with a warning: a Partune
    upgrade that changes the features must not stop every later search."""
    from partune.core import PartuneError

    if kept is None:
        return None
    try:
        return kept.load()
    except (OSError, ValueError) as e:
        if required:
            raise PartuneError(f"cannot use {kept}: {e}") from None
        print(
            f"partune: warning: {kept} cannot be used ({e}); this run measures every "
            "candidate and trains a new one there",
            file=sys.stderr,
        )
        return None


def _update_cost_model(kept, cost_model, result, model) -> str:
    """Train on what this run measured (continuing from the loaded model) and save."""
    import numpy as np

    from partune.cost_models import XGBoostCostModel, featurize

    done = [(c, m) for c, m in result.trained if m.ok]
    if result.cost_model is not None:  # it learned this run's candidates during the search
        kept.save(result.cost_model)
        return (
            f"cost model: {result.counts.skipped} candidates not measured (ranked out); {kept} "
            "updated in-run with this model's measurements"
        )
    if not done:
        return f"{kept}: nothing new to learn"
    x = np.stack([featurize(model.graph, c.subgraph.nodes, c.backend) for c, _ in done])
    y = np.array([m.cost_s for _, m in done])
    updated = (cost_model or XGBoostCostModel()).update(x, y)
    kept.save(updated)
    return (
        f"cost model: {result.counts.skipped} candidates not measured (ranked out); "
        f"{kept} updated with {len(done)} measurements"
    )
