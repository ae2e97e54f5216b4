"""MetaSchedule tuning of single regions into one persistent database.

Untuned TVM runs matmul and conv 100x-250x slower than a BLAS (DESIGN.md); tuning closes
the gap but costs tens of seconds per task. So tuning is done per region, only for the
regions the search wants, and every result is kept: all regions tuned for one target
share one MetaSchedule ``JSONDatabase``, keyed by the structure of each TIR task
(MetaSchedule's structural hash), and a task tuned once is reused by every later region,
model and run.

Budget: ``max_trials`` is split over a region's tasks, a quarter evenly and the rest in
proportion to weight x FLOPs (whole trials summing to ``max_trials``; with a small
budget a minor task may get none and keeps TVM's default schedule). A task counts as
tuned, and is skipped, when the database holds at least its share of valid records, or a
run that finished (not killed, not timed out) already gave it that share: a search space
smaller than the share would otherwise be tuned again on every call. A larger budget
later tunes a task further, from where it stands.

Resumption: MetaSchedule appends every measured record to the JSON-lines file as soon as
its batch is measured, so a run killed with SIGKILL keeps all batches before the one in
flight. The rerun finds those records, tunes the task only for the rest of its share, and
the evolutionary search starts from the best records in the database. A kill in the
middle of a write can leave a partial last line, which makes MetaSchedule refuse the whole
file ("Unexpected end of string"); it is cut off before the database is opened.

The database the tuning writes (its layout per target, repair, locking, snapshots for
builds) is ``tvm_tuning_database``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.s_tir.meta_schedule.utils import fork_seed

from partune.backends.tvm_backend import lower_fused, region_module
from partune.backends.tvm_tuning_database import (
    TuningError,
    database_path,
    locked,
    read_state,
    repair,
    target_json,
    write_state,
)

TRIALS_PER_ITER = 8
# MetaSchedule's evolutionary search, scaled to regions (its defaults, population 512 and
# 4 generations, suit whole models). On gpt2-small's layer_norm and matmul regions with 32
# trials, 128 and 2 took 34 s and 26 s instead of 61 s and 41 s, and found schedules as
# fast (0.93 vs 1.03 us, 21.1 vs 21.0 us); 64 and 1 saved little more.
EVOLUTION = {"population_size": 128, "genetic_num_iters": 2}
_ALL = 10**9  # "every record" for get_top_k
_log = logging.getLogger(__name__)


def _one_line(e: BaseException, limit: int = 300) -> str:
    """The last line of an exception's message (where TVM puts the reason), or its type."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:limit]


@dataclass(frozen=True)
class TaskReport:
    """One TIR task of the region: its budget, what was done this call, its best latency."""

    name: str
    workload: str  # MetaSchedule's structural hash of the task (its database key)
    flops: float
    share: int  # trials budgeted for the task by this call
    records_before: int  # valid records in the database when this call started
    trials_run: int  # candidates measured by this call
    # reused: already tuned, nothing run; tuned: brought to its share now; partial:
    # stopped by the deadline; unbudgeted: a share of 0 and nothing in the database.
    status: Literal["reused", "tuned", "partial", "unbudgeted"]
    best_s: float | None  # best measured latency in the database after this call

    @property
    def reused(self) -> bool:
        """Already tuned in the database: this call ran nothing for it."""
        return self.status == "reused"


@dataclass(frozen=True)
class TuningReport:
    """What ``tune_region`` did: per task, in total, and how long it took."""

    tasks: tuple[TaskReport, ...]
    trials_run: int
    tasks_reused: int
    seconds: float
    timed_out: bool
    database: str  # the target's database directory

    @property
    def best_s(self) -> dict[str, float | None]:
        """Best known latency per task name."""
        return {t.name: t.best_s for t in self.tasks}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> TuningReport:
        return cls(**{**obj, "tasks": tuple(TaskReport(**t) for t in obj["tasks"])})


# ---------------------------------------------------------------------------------------
# MetaSchedule pieces


_INTRINSICS: dict[str, tuple[str, ...]] = {
    "llvm": ("x86", "arm_cpu", "riscv_cpu"),
    "cuda": ("cuda",),
    "rocm": ("rocm",),
    "hexagon": ("hexagon",),
    "metal": ("metal",),
}


def _load_intrinsics(target: tvm.target.Target) -> None:
    """Register only the tensor intrinsics ``target`` can use.

    ``TuneContext`` imports ``tvm.s_tir.tensor_intrin``, whose ``__init__`` registers every
    intrinsic of every target: 21 s here, 14 s of it CUDA's. For an llvm target the
    package is put in place without running ``__init__`` and only the CPU modules are
    imported (1.2 s); any other submodule still imports on demand.
    """
    name = "tvm.s_tir.tensor_intrin"
    subs = _INTRINSICS.get(target.kind.name)
    if subs is None:
        if name in sys.modules and not hasattr(sys.modules[name], "enabled"):  # placeholder
            subs = tuple(s for t in _INTRINSICS.values() for s in t)
        else:
            importlib.import_module(name)
            return
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise TuningError(f"{name} not found")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        tvm.s_tir.tensor_intrin = sys.modules[name]  # type: ignore[attr-defined]
    for sub in subs:
        importlib.import_module(f"{name}.{sub}")


def build_without_intrinsics(mod: tvm.IRModule, target: tvm.target.Target, _params: Any) -> Any:
    """MetaSchedule's default build minus its ``import tvm.s_tir.tensor_intrin`` (13-17 s per
    builder process): candidates are already scheduled, ``tvm.tirx.build`` needs nothing more.
    """
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


@derived_object
class _Progress(ms.measure_callback.PyMeasureCallback):
    """Counts measured candidates and stops the task at the deadline.

    Terminating from the callback lets the batch in flight finish and be recorded, so a
    deadline never throws away work (checked on TVM 0.27).
    """

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.trials = 0
        self.timed_out = False

    def apply(
        self, task_scheduler, task_id, measure_candidates, builder_results, runner_results
    ) -> None:
        self.trials += len(runner_results)
        if self.deadline is not None and time.monotonic() > self.deadline and not self.timed_out:
            self.timed_out = True
            task_scheduler.terminate_task(task_id)


def tuning_target(target: tvm.target.Target) -> tvm.target.Target:
    """MetaSchedule's CPU rules need ``num-cores``; default to one (one thread per backend)."""
    if target.kind.name == "llvm" and "num-cores" not in target.attrs:
        return tvm.target.Target({**target_json(target), "num-cores": 1})
    return target


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Environment for the builder and runner processes MetaSchedule starts."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shares(weights: list[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights``, whole numbers summing to ``total``."""
    if not weights or total <= 0:
        return [0] * len(weights)
    s = sum(weights)
    exact = [total * w / s for w in weights] if s > 0 else [total / len(weights)] * len(weights)
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def budget_shares(work: list[float], total: int) -> list[int]:
    """Trials per task: a quarter of ``total`` evenly, the rest in proportion to ``work``.

    By FLOPs alone a softmax beside a matmul would never be tuned; evenly, the matmul
    that dominates the region would be starved.
    """
    even = _shares([1.0] * len(work), total // 4)
    return [a + b for a, b in zip(even, _shares(work, total - sum(even)), strict=True)]


def _flops(mod: tvm.IRModule) -> float:
    try:
        return max(float(estimate_tir_flops(mod)), 1.0)
    except Exception:  # noqa: BLE001 - an opaque task still deserves a share
        return 1.0


def _records(db: ms.database.Database, workload: ms.database.Workload) -> list:
    return list(db.get_top_k(workload, _ALL))


def _best_s(records: list) -> float | None:
    secs = [sum(float(s) for s in r.run_secs) / len(r.run_secs) for r in records if r.run_secs]
    return min(secs) if secs else None


# ---------------------------------------------------------------------------------------
# Tuning


def extract_tasks(func: relax.Function, target: tvm.target.Target) -> list[ms.ExtractedTask]:
    """The TIR tasks of a region, as the build will look them up (same lowering,
    ``lower_fused``)."""
    fused = lower_fused(region_module(func), target)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    return [t for t in tasks if not t.dispatched[0].attrs.get("tirx.is_scheduled", False)]


def tune_region(
    func: relax.Function,
    target: tvm.target.Target,
    database_dir: str,
    max_trials: int,
    timeout_s: float | None = None,
    *,
    trials_per_iter: int = TRIALS_PER_ITER,
    builder_workers: int = 1,
    search_threads: int = 1,
    seed: int | None = None,
    isolate: bool = False,
) -> TuningReport:
    """Tune the TIR tasks of one region into the persistent database under ``database_dir``.

    ``func`` is a region as the search lifts it (tensor params, one dataflow block, weights
    as constants). Tasks already tuned in the database are skipped, so a second call runs
    no trials; ``timeout_s`` stops tuning after the batch in flight. ``isolate`` runs the
    tuning in a child process, so that even a crash inside TVM (a segfault) only costs
    that process. Every failure is raised as ``TuningError``.
    """
    if isolate:
        return _tune_in_child(
            func,
            target,
            database_dir,
            max_trials,
            timeout_s,
            trials_per_iter=trials_per_iter,
            builder_workers=builder_workers,
            search_threads=search_threads,
            seed=seed,
        )
    start = time.monotonic()
    deadline = start + timeout_s if timeout_s is not None else None
    try:
        target = tuning_target(target)
        path = database_path(database_dir, target)
        os.makedirs(path, exist_ok=True)
        tasks = extract_tasks(func, target)
        with locked(path, deadline):
            return _tune_locked(
                tasks,
                target,
                path,
                max_trials,
                start,
                deadline,
                trials_per_iter,
                builder_workers,
                search_threads,
                seed,
            )
    except TuningError:
        raise
    except Exception as e:  # noqa: BLE001 - one exception type for callers, whatever broke
        raise TuningError(f"tuning failed: {_one_line(e)}") from e


def _tune_locked(
    tasks: list[ms.ExtractedTask],
    target: tvm.target.Target,
    path: str,
    max_trials: int,
    start: float,
    deadline: float | None,
    trials_per_iter: int,
    builder_workers: int,
    search_threads: int,
    seed: int | None,
) -> TuningReport:
    repair(path)
    db = ms.database.JSONDatabase(work_dir=path)
    state = read_state(path)
    mods = [t.dispatched[0] for t in tasks]
    flops = [_flops(m) for m in mods]
    shares = budget_shares(
        [float(t.weight) * f for t, f in zip(tasks, flops, strict=True)], max_trials
    )
    reports: list[TaskReport] = []
    timed_out = False
    runner = builder = None
    try:
        for task, mod, flop, share in zip(tasks, mods, flops, shares, strict=True):
            key = str(tvm_ffi.structural_hash(mod))  # MetaSchedule's key of the workload
            workload = db.commit_workload(mod) if db.has_workload(mod) else None
            before = len(_records(db, workload)) if workload is not None else 0
            given = max(before, state.get(key, 0))  # trials the task has had already
            done = given >= share
            trials, status = 0, "reused" if before > 0 or key in state else "unbudgeted"
            if not done and deadline is not None and time.monotonic() > deadline:
                timed_out, status = True, "partial"
            elif not done:
                if runner is None:
                    with _env(TVM_NUM_THREADS=str(int(target.attrs.get("num-cores", 1)))):
                        _load_intrinsics(target)
                        builder = ms.builder.LocalBuilder(
                            max_workers=builder_workers, f_build=build_without_intrinsics
                        )
                        runner = ms.runner.LocalRunner()
                progress = _Progress(deadline)
                _tune_task(
                    task,
                    target,
                    path,
                    db,
                    share - given,
                    trials_per_iter,
                    builder,
                    runner,
                    progress,
                    search_threads,
                    seed,
                )
                trials = progress.trials
                workload = db.commit_workload(mod)
                if progress.timed_out:
                    timed_out, status = True, "partial"
                else:  # finished: the share is spent even if the search space ran out first
                    state[key] = max(state.get(key, 0), share)
                    write_state(path, state)
                    status = "tuned"
            records = _records(db, workload) if workload is not None else []
            reports.append(
                TaskReport(
                    str(task.task_name), key, flop, share, before, trials, status, _best_s(records)
                )
            )  # type: ignore[arg-type]
    finally:
        if runner is not None:
            runner.pool.shutdown()
    return TuningReport(
        tuple(reports),
        sum(r.trials_run for r in reports),
        sum(r.reused for r in reports),
        time.monotonic() - start,
        timed_out,
        path,
    )


def _tune_task(
    task: ms.ExtractedTask,
    target: tvm.target.Target,
    path: str,
    db: ms.database.Database,
    trials: int,
    trials_per_iter: int,
    builder: ms.builder.Builder,
    runner: ms.runner.Runner,
    progress: _Progress,
    search_threads: int,
    seed: int | None,
) -> None:
    """One task, on its own: each task gets exactly its share, and a kill loses one task's batch.

    The context is made here rather than by ``extracted_tasks_to_tune_contexts``: that one
    calls ``logging.config.dictConfig``, which closes every logging handler of the process
    (the caller's included) and fails outright when a logger holds an unnamed handler
    (under pytest: "'NoneType' object has no attribute 'format'"). MetaSchedule's messages
    go to the ``partune.backends.tvm_tuning`` and ``tvm.s_tir.meta_schedule`` loggers instead.
    """
    context = ms.TuneContext(
        mod=task.dispatched[0],
        target=target,
        space_generator="post-order-apply",
        search_strategy=ms.search_strategy.EvolutionarySearch(**EVOLUTION),
        task_name=str(task.task_name),
        logger=_log,
        rand_state=fork_seed(seed, 1)[0],
        num_threads=search_threads,
    ).clone()
    callbacks = [*ms.measure_callback.MeasureCallback.create("default"), progress]
    with _env(TVM_NUM_THREADS=str(int(target.attrs.get("num-cores", 1)))):
        ms.tune_tasks(
            tasks=[context],
            task_weights=[1.0],
            work_dir=path,
            max_trials_global=trials,
            max_trials_per_task=trials,
            num_trials_per_iter=max(1, min(trials_per_iter, trials)),
            builder=builder,
            runner=runner,
            database=db,
            measure_callbacks=callbacks,
        )


# ---------------------------------------------------------------------------------------
# A child process per tuning run (``isolate``), and the command line it runs


def _tune_in_child(
    func: relax.Function,
    target: tvm.target.Target,
    database_dir: str,
    max_trials: int,
    timeout_s: float | None,
    **options: Any,
) -> TuningReport:
    """Run ``python -m partune.backends.tvm_tuning`` on the region; its death is a
    ``TuningError``."""
    with tempfile.TemporaryDirectory(prefix="partune-tune-") as tmp:
        module, report = os.path.join(tmp, "region.json"), os.path.join(tmp, "report.json")
        with open(module, "w") as f:
            f.write(tvm.ir.save_json(region_module(func)))
        cmd = [
            sys.executable,
            "-m",
            "partune.backends.tvm_tuning",
            "--module",
            module,
            "--target",
            json.dumps(target_json(target)),
            "--database",
            database_dir,
            "--trials",
            str(max_trials),
            "--report",
            report,
        ]
        if timeout_s is not None:
            cmd += ["--timeout", str(timeout_s)]
        for k, v in options.items():
            if v is not None:
                cmd += [f"--{k.replace('_', '-')}", str(v)]
        # The last batch may overrun the deadline; after that the child is stuck.
        wait = None if timeout_s is None else timeout_s + 300
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TuningError(
                f"tuning process still running {wait:.0f} s after start; killed"
            ) from None
        if os.path.exists(report):
            with open(report) as f:
                out = json.load(f)
            if "error" in out:
                raise TuningError(out["error"])
            return TuningReport.from_json(out["report"])
        if proc.returncode < 0:
            raise TuningError(f"tuning process died of {signal.Signals(-proc.returncode).name}")
        tail = err.decode(errors="replace").strip().splitlines()
        raise TuningError(f"tuning process exited {proc.returncode}: {tail[-1] if tail else ''}")


def main(argv: list[str] | None = None) -> int:
    """Tune one region saved with ``tvm.ir.save_json`` (an IRModule whose ``main`` is the
    region)."""
    p = argparse.ArgumentParser(
        prog="python -m partune.backends.tvm_tuning", description=main.__doc__
    )
    p.add_argument("--module", required=True)
    p.add_argument("--target", required=True, help="target as a JSON dict")
    p.add_argument("--database", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--timeout", type=float)
    p.add_argument("--trials-per-iter", type=int, default=TRIALS_PER_ITER)
    p.add_argument("--builder-workers", type=int, default=1)
    p.add_argument("--search-threads", type=int, default=1)
    p.add_argument("--seed", type=int)
    p.add_argument("--report", help="write the report (or the error) here as JSON")
    args = p.parse_args(argv)
    try:
        with open(args.module) as f:
            func = tvm.ir.load_json(f.read())["main"]
        report = tune_region(
            func,
            tvm.target.Target(json.loads(args.target)),
            args.database,
            args.trials,
            args.timeout,
            trials_per_iter=args.trials_per_iter,
            builder_workers=args.builder_workers,
            search_threads=args.search_threads,
            seed=args.seed,
        )
        out: dict = {"report": report.to_json()}
        code = 0
    except TuningError as e:
        out, code = {"error": str(e)}, 2
    except Exception as e:  # noqa: BLE001 - reading the request failed
        out, code = {"error": f"tuning failed: {_one_line(e)}"}, 2
    if args.report:
        with open(args.report, "w") as f:
            json.dump(out, f)
    else:
        print(json.dumps(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
