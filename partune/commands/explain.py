"""``partune explain``: why each region of a plan went where it went. It reads; it measures
nothing."""

from __future__ import annotations

import argparse
import json
import os
import sys

from partune.commands.common import (
    job_attrs,
    load_model,
    shape_flags,
    sqlite_file,
    study_summaries,
)


def cmd_explain(args: argparse.Namespace) -> int:
    """A study's emitted plan, or a plan file, region by region against every backend on offer
    (a plan file with shape buckets: each bucket's plan at its point, then the buckets)."""
    from partune.core import ShapePlans, load_plans

    if args.plan and isinstance(plans := load_plans(args.plan), ShapePlans):
        return _explain_buckets(args, plans)
    plan, source = _read_plan(args)
    return _explain_one(args, plan, source)


def _explain_one(args: argparse.Namespace, plan, source: str) -> int:
    """One plan, region by region, against what the storage measured."""
    from partune.backends import registry
    from partune.core import PlanError
    from partune.explain import explain, render_text, to_json
    from partune.explain_evidence import gather_evidence

    model = _load_for(args, plan)
    if plan.fingerprint != model.graph.fingerprint:
        raise PlanError(
            f"the plan was made for another model (fingerprint {plan.fingerprint}, "
            f"{model.name} is {model.graph.fingerprint})"
        )
    plan.validate(model.graph, registry.names())
    device, measured = _measurements(args, plan)
    facts = explain(plan, model.graph, gather_evidence(plan, model, measured, device), source)
    print(json.dumps(to_json(facts), indent=1) if args.json else render_text(facts))
    return 0


def _explain_buckets(args: argparse.Namespace, plans) -> int:
    """Each bucket's plan explained at its own shapes, then what each bucket serves."""
    from partune.commands.tune_shapes import bucket_table
    from partune.frontend import read_file_shapes

    if not args.model:
        from partune.core import PartuneError

        raise PartuneError("explain --plan with shape buckets needs the MODEL file it was tuned on")
    names = [name for name, _ in read_file_shapes(args.model).inputs]
    for i, bucket in enumerate(plans.buckets):
        print(f"== bucket{i}: {plans.spans()[i]} (tuned at {bucket.inputs}) ==")
        args.input_shape = shape_flags(dict(zip(names, bucket.inputs, strict=True)))
        _explain_one(args, bucket.plan, f"plan file {args.plan}, bucket{i}")
    print(bucket_table(plans))
    return 0


def _storage_exists(url: str) -> bool:
    """Whether ``url`` names a storage that may hold something: reading must not create one."""
    from partune.core import PartuneError
    from partune.store import MEMORY

    if url in (MEMORY, "sqlite:///:memory:"):
        raise PartuneError(
            f"storage '{url}' keeps nothing after its run: explain reads the --storage "
            "that `partune tune` wrote"
        )
    path = sqlite_file(url)
    return path is None or os.path.isfile(path)


def _read_plan(args: argparse.Namespace):
    """(the plan, where it came from in words); the model and shapes the study names go to
    ``args``."""
    from partune.core import PartuneError, Plan

    if args.plan:
        return Plan.load(args.plan), f"plan file {args.plan}"
    if not args.study:
        raise PartuneError(
            "explain needs --study NAME (and --storage) of a tuning job, or --plan FILE"
        )
    if not _storage_exists(args.storage):
        raise PartuneError(
            f"no storage at {sqlite_file(args.storage)} (see `partune status --storage URL`)"
        )
    attrs = job_attrs(args.storage, args.study)
    args.model = args.model or attrs.get("model")
    args.input_shape = args.input_shape or attrs.get("input_shape")
    args.disable_pass = args.disable_pass or attrs.get("disabled_passes")
    return Plan.from_json(attrs["best_plan"]), f"study '{args.study}' in {args.storage}"


def _load_for(args: argparse.Namespace, plan):
    """The model the plan is for: MODEL, else the one its study or the plan itself names."""
    from partune.core import ModelError, PartuneError

    named = bool(args.model)
    args.model = args.model or plan.model
    try:
        return load_model(args)
    except ModelError as e:
        if named:
            raise
        raise PartuneError(
            f"the plan is for '{plan.model}', which cannot be loaded by that name ({e}): "
            "name its file, partune explain MODEL --plan FILE"
        ) from None


def _measurements(args: argparse.Namespace, plan) -> tuple[str, dict]:
    """(device, its measurements): --device, else this machine at the plan's thread count, else
    the device with the most measurements in the storage (said on stderr)."""
    from partune.core import device_fingerprint
    from partune.explain_evidence import read_measurements
    from partune.store import STUDY_PREFIX

    target = plan.config.default.target or {}
    device = args.device or device_fingerprint(int(target.get("num-cores", args.threads)))
    if not _storage_exists(args.storage):
        print(
            f"partune: note: no storage at {sqlite_file(args.storage)}: no measurements to show",
            file=sys.stderr,
        )
        return device, {}
    measured = read_measurements(args.storage, device)
    if measured is not None or args.device:
        return device, measured or {}
    stores = [s for s in study_summaries(args.storage) if s.study_name.startswith(STUDY_PREFIX)]
    if not stores:
        return device, {}
    other = max(stores, key=lambda s: s.n_trials).study_name[len(STUDY_PREFIX) :]
    print(
        f"partune: note: {args.storage} holds no measurements of this machine at the plan's thread "
        f"count; showing device {other}'s (choose with --device)",
        file=sys.stderr,
    )
    return other, read_measurements(args.storage, other) or {}
