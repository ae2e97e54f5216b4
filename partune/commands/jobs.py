"""Subcommands about jobs and the machine: export, status, report, cost-model evaluation, RPC
server, lists."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from partune.commands.common import (
    format_duration,
    is_zoo,
    job_attrs,
    load_model,
    read_samples,
    study_summaries,
)


def cmd_export(args: argparse.Namespace) -> int:
    """A deploy directory from a plan file, or from the best plan a tuning study stored."""
    from partune.core import PartuneError, Plan, ShapePlans, load_plans
    from partune.export import export

    spec, shapes = args.model, args.input_shape
    if args.plan:
        if not spec:
            raise PartuneError("export --plan needs the MODEL the plan was made for")
        plan = load_plans(args.plan)
        if isinstance(plan, ShapePlans):
            return _export_buckets(args, plan)
    else:
        if not args.study:
            raise PartuneError(
                "export needs --plan FILE, or --study NAME (and --storage) of a tuning job"
            )
        attrs = job_attrs(args.storage, args.study)
        plan = Plan.from_json(attrs["best_plan"])
        spec = spec or attrs.get("model")
        shapes = shapes or attrs.get("input_shape")
        args.disable_pass = args.disable_pass or attrs.get("disabled_passes")
        args.calibration = args.calibration or attrs.get("calibration")
        args.validation = args.validation or attrs.get("validation")
    args.model, args.input_shape = spec, shapes
    model = load_model(args)
    if plan.fingerprint != model.graph.fingerprint:
        raise PartuneError(
            f"the plan was made for another model (fingerprint {plan.fingerprint}, "
            f"{model.name} is {model.graph.fingerprint})"
        )
    try:
        out = export(model, plan, args.output, args.threads, samples_of(args, model))
    except FileExistsError as e:
        raise PartuneError(str(e)) from None
    print(f"exported {model.name} under its plan ({', '.join(plan.backends)}) to {out}/")
    print(f"run it:  partune run {out}    or in Python: partune.deployed.load('{out}')(*inputs)")
    return 0


def samples_of(args: argparse.Namespace, model):
    """The samples a model-file plan's file was quantized on (``--calibration``,
    ``--validation``), as ``TuneOptions``; None without them (the synthetic ones)."""
    if not args.calibration:
        if args.validation:
            from partune.core import PartuneError

            raise PartuneError("--validation needs --calibration (the samples to calibrate on)")
        return None
    from partune.search import TuneOptions

    calibration, validation, _ = read_samples(args.calibration, args.validation, model)
    return TuneOptions(calibration=calibration, validation=validation)


def _export_buckets(args: argparse.Namespace, plans) -> int:
    """A deploy directory serving every shape bucket of ``plans``, each imported at its point."""
    from partune.core import PartuneError
    from partune.export_shapes import export_buckets
    from partune.frontend import read_file_shapes

    if args.input_shape:
        raise PartuneError("a plan with shape buckets sets its own shapes: drop --input-shape")
    names = [name for name, _ in read_file_shapes(args.model).inputs]

    def load_at(i: int):
        shapes = plans.buckets[i].inputs
        args.input_shape = [
            f"{n}={','.join(map(str, s))}" for n, s in zip(names, shapes, strict=True)
        ]
        model = load_model(args)
        if plans.buckets[i].plan.fingerprint != model.graph.fingerprint:
            raise PartuneError(
                f"bucket {i} was made for another model (fingerprint "
                f"{plans.buckets[i].plan.fingerprint}, {model.name} is {model.graph.fingerprint})"
            )
        return model

    try:
        out = export_buckets(plans, load_at, args.output, args.threads)
    except FileExistsError as e:
        raise PartuneError(str(e)) from None
    print(f"exported {args.model} with {len(plans.buckets)} shape buckets to {out}/:")
    for i, span in enumerate(plans.spans()):
        print(f"  bucket{i}: {span}")
    print(f"  any other shape: your file under {plans.fallback}")
    print(f"run it in Python: partune.deployed.load('{out}')(*inputs)  (any shape your file takes)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Every tuning job in a storage: progress, time left, emitted plan and its standing."""
    import time

    from partune.core import fit_table
    from partune.store import STUDY_PREFIX

    summaries = study_summaries(args.storage)
    stores = [s for s in summaries if s.study_name.startswith(STUDY_PREFIX)]
    trials = {s.study_name: s.n_trials for s in summaries}
    jobs = [s for s in summaries if "best_plan" in s.user_attrs or "started" in s.user_attrs]
    print(
        f"{args.storage}: {sum(s.n_trials for s in stores)} measurements on {len(stores)} "
        f"device(s), {len(jobs)} tuning job(s)"
    )
    _print_fleet(args.storage)
    if not jobs:
        return 0
    now, rows = time.time(), []
    for s in sorted(jobs, key=lambda s: s.datetime_start or 0):
        rows.append(_status_row(s.study_name, s.user_attrs, trials, now))
    for line in fit_table(
        (
            "study",
            "state",
            "refined",
            "emitted plan",
            "backends",
            "ms",
            "x best peer",
            "peak memory",
        ),
        rows,
        "<<><<>><",
        pipes=True,
    ):
        print(line)
    return 0


def _print_fleet(storage, window_s: float = 600.0) -> None:
    """The devices that measured in the last ``window_s``, their rate and their workers
    (a worker's latest measurement is its heartbeat)."""
    from partune.core import fit_table
    from partune.store import fleet_activity

    active = [d for d in fleet_activity(storage, window_s) if d.workers]
    if not active:
        return
    rows = [
        [
            d.device,
            f"{d.per_minute:.1f}",
            str(d.measurements),
            ", ".join(
                f"{w.worker} ({w.recent}, {format_duration(w.last_s)} ago)" for w in d.workers
            ),
        ]
        for d in active
    ]
    print(f"measuring in the last {format_duration(window_s)}:")
    for line in fit_table(
        ("device", "per minute", "stored", "workers (measurements, last seen)"),
        rows,
        "<>><",
        pipes=True,
    ):
        print(line)


def _status_row(name: str, attrs: dict, trials: dict[str, int], now: float) -> list[str]:
    """One job's cells in `partune status`: all of each, the columns fit them."""
    if attrs.get("finished") or "started" not in attrs:
        state = "done"
    elif (attrs.get("stopped") or 0) > attrs["started"]:
        state = "stopped (resumable)"
    elif attrs.get("deadline"):
        left = attrs["deadline"] - now
        state = f"running, {format_duration(left)} left" if left > 0 else "running, overtime"
    else:
        state = f"running {format_duration(now - attrs['started'])}"
    if state.startswith("running") and (phase := (attrs.get("running") or {}).get("phase")):
        state += f": {phase}"
    memory = _memory_cell(attrs.get("memory"))
    bound = attrs.get("n_trials", "?")  # None: a budget's refinement, until it converges
    refined = (
        f"{trials.get(attrs['refine_study'], 0)}"
        + (f"/{bound}" if bound is not None else " (to convergence)")
        if attrs.get("refine_study")
        else "-"
    )
    plan = attrs.get("best_plan")
    if plan is None:
        return [name, state, refined, "(none yet)", "-", "-", "-", memory]
    notes = plan.get("notes", {})
    backends = "+".join(sorted({r["scope"]["backend"] for r in plan["regions"]}))
    ms = notes.get("verdict_median_s", {}).get(
        notes.get("chosen_as"), notes.get("measured_s", float("nan"))
    )
    x = notes.get("speedup_vs_best_peer")
    return [
        name,
        state,
        refined,
        str(notes.get("chosen_as", "?")),
        backends,
        f"{ms * 1e3:.3f}",
        f"{x:.2f}x" if x else "-",
        memory,
    ]


def _memory_cell(peaks: dict | None) -> str:
    """A job's peak resident sizes (``MemoryPeaks`` as stored), as the summary says them."""
    from partune.commands.summary import memory_line
    from partune.search import MemoryPeaks

    if not peaks or not peaks.get("search"):
        return "-"
    try:
        return memory_line(MemoryPeaks(**peaks)).removeprefix("peak memory: ")
    except TypeError:  # written by another version
        return "-"


def cmd_report(args: argparse.Namespace) -> int:
    """Markdown and PNG plots for one tuning job."""
    from partune.core import PartuneError, Plan
    from partune.report import write_report

    attrs = job_attrs(args.storage, args.study)
    model = None
    if attrs.get("model"):
        args.model, args.input_shape = attrs["model"], attrs.get("input_shape")
        args.disable_pass = args.disable_pass or attrs.get("disabled_passes")
        try:
            model = load_model(args)
        except PartuneError as e:  # the report still has its tables and plots without the graph
            print(f"partune: note: no graph picture ({e})", file=sys.stderr)
    path = write_report(
        args.storage,
        args.study,
        Plan.from_json(attrs["best_plan"]),
        Path(args.output),
        model,
        attrs.get("refine_study"),
    )
    print(
        f"report written to {path} (with "
        f"{', '.join(sorted(p.name for p in path.parent.glob('*.png')))})"
    )
    return 0


def cmd_costmodel_eval(args: argparse.Namespace) -> int:
    """Leave-one-model-out: how well the cost model ranks each DP frontier's candidates."""
    from partune.core import PartuneError
    from partune.cost_models import XGBoostCostModel
    from partune.frontend import load
    from partune.search import Samples, leave_one_model_out, samples_for
    from partune.store import STUDY_PREFIX, MeasurementStore

    stores = [s for s in study_summaries(args.storage) if s.study_name.startswith(STUDY_PREFIX)]
    if not stores:
        raise PartuneError(f"{args.storage} holds no measurements (run `partune tune` first)")
    device = args.device or max(stores, key=lambda s: s.n_trials).study_name[len(STUDY_PREFIX) :]
    store = MeasurementStore(args.storage, device)
    labels = {
        t.user_attrs.get("label", "").split(" ")[0] for t in store.study.get_trials(deepcopy=False)
    }
    specs = args.models.split(",") if args.models else sorted(n for n in labels if is_zoo(n))
    backends = [b.strip() for b in args.backends.split(",")]
    data: list[Samples] = []
    for spec in specs:
        s = samples_for(load(spec), store, backends, args.threads)
        print(f"{spec}: {len(s.seconds)} measured candidates", file=sys.stderr)
        if len(s.seconds):
            data.append(s)
    if len(data) < 2:
        raise PartuneError(
            "leave-one-model-out needs measurements of at least two models "
            f"(found {len(data)}; name them with --models)"
        )
    scores = leave_one_model_out(data)
    print(
        f"device {device}; {sum(len(s.seconds) for s in data)} measurements of {len(data)} models; "
        "each model held out, the XGBoost model trained on the others"
    )
    print(
        f"| {'held-out model':<22} | {'candidates':>10} | {'frontiers':>9} | {'Spearman':>8} | "
        f"{'top-1':>6} | {'top-3':>6} |"
    )
    print("|" + "|".join("-" * w for w in (24, 12, 11, 10, 8, 8)) + "|")
    for sc in scores:
        print(
            f"| {sc.model:<22} | {sc.samples:>10} | {sc.frontiers:>9} | {sc.spearman:8.3f} | "
            f"{sc.top1:6.1%} | {sc.top3:6.1%} |"
        )
    rho, top1, top3 = (
        sum(getattr(s, f) for s in scores) / len(scores) for f in ("spearman", "top1", "top3")
    )
    print(f"| {'mean':<22} | {'':>10} | {'':>9} | {rho:8.3f} | {top1:6.1%} | {top3:6.1%} |")
    if args.save:
        import numpy as np

        model = XGBoostCostModel().fit(
            np.concatenate([s.x for s in data]), np.concatenate([s.seconds for s in data])
        )
        model.save(args.save)
        print(f"cost model trained on all {model.trained_on} measurements saved to {args.save}")
    return 0


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from partune.runners import serve

    serve(args.tracker, args.key, host=args.host, port=args.port, port_end=args.port_end)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from partune.frontend import ZOO

    for name in sorted(ZOO):
        print(f"{name:<22} {ZOO[name].family:<12} {ZOO[name].description}")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from partune.backends import registry

    for name in registry.names():
        b = registry.get(name)
        print(
            f"{name:<12} level={b.level.value:<9} fusion={b.fusion_style.value:<9} "
            f"devices={','.join(b.device_types)}"
        )
    return 0
