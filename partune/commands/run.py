"""``partune run``, ``bench`` and ``headroom``: a model under a plan, single-backend plans against
the peers, and how much any plan could gain over the libraries."""

from __future__ import annotations

import argparse
import os

from partune.commands.common import load_model


def _backend_plan(model, backend: str, threads: int):
    from partune.core import CompilationConfig
    from partune.search import backend_plan

    config = CompilationConfig.for_cpu([backend], threads)
    return backend_plan(model.name, model.mod, model.graph, config, backend)


def cmd_run_deployed(args: argparse.Namespace) -> int:
    """Run a deploy directory: only partune.deployed and the backends are imported."""
    import numpy as np

    from partune.deployed import DeployError, load
    from partune.runners import time_callable

    model = load(args.model, args.threads)
    m = model.manifest
    if "buckets" in m:
        return _run_buckets(args, model)
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
        print(
            f"deployed   {m['model']} (the model's own ONNX graph, {file['origin']}, under "
            f"{file['library']})"
        )
    else:
        print(
            f"deployed   {m['model']} ({len(m['regions'])} library regions: "
            f"{', '.join(m['backends']) or 'none'}; plan backends {', '.join(m['plan_backends'])})"
        )
    print(
        f"latency    {m_time.median_s * 1e3:.3f} ms median, {m_time.cost_s * 1e3:.3f} ms best "
        f"({args.threads} thread(s); {m_numpy.median_s * 1e3:.3f} ms median with numpy in and out)"
    )
    if not args.input:
        from partune.bench import max_abs_error

        err = max_abs_error(outputs, model.reference_outputs())
        print(f"max |err|  {err:.3g} vs {m['reference']} (example inputs)")
    for i, o in enumerate(outputs):
        if args.output:
            np.save(f"{args.output}_{i}.npy", o)
        print(
            f"output {i}   {o.dtype}{list(o.shape)}"
            + (f" -> {args.output}_{i}.npy" if args.output else "")
        )
    return 0


def _run_buckets(args: argparse.Namespace, model) -> int:
    """A deployment with shape buckets: each bucket at its own example inputs (its latency and
    error), or the given inputs through the dispatch."""
    import numpy as np

    from partune.bench import max_abs_error
    from partune.runners import time_callable

    print(f"deployed   {model.manifest['model']} with {len(model.buckets)} shape buckets")
    if args.input:
        inputs = [np.load(f, allow_pickle=False) for f in args.input]
        t = time_callable(model.prepare(*inputs))
        outputs = model(*inputs)
        route = model.plans.route([a.shape for a in inputs])
        where = (
            f"your file under {model.plans.fallback}"
            if route.bucket is None
            else f"bucket{route.bucket}" + (" padded" if route.padded else "")
        )
        print(f"latency    {t.median_s * 1e3:.3f} ms median ({where}; {args.threads} thread(s))")
        for i, o in enumerate(outputs):
            if args.output:
                np.save(f"{args.output}_{i}.npy", o)
            print(f"output {i}   {o.dtype}{list(o.shape)}")
        return 0
    for i, (bucket, span) in enumerate(zip(model.buckets, model.plans.spans(), strict=True)):
        inputs = bucket.example_inputs()
        t = time_callable(model.prepare(*inputs))
        err = max_abs_error(model(*inputs), bucket.reference_outputs())
        print(
            f"bucket{i}    {t.median_s * 1e3:.3f} ms median at its point ({span}); max |err| "
            f"{err:.3g} vs {bucket.manifest['reference']}"
        )
    print(f"any other shape: your file under {model.plans.fallback}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if os.path.isdir(args.model):
        return cmd_run_deployed(args)
    from partune.bench import max_abs_error
    from partune.core import Plan
    from partune.runners import build_plan, time_callable

    model = load_model(args)
    plan = Plan.load(args.plan) if args.plan else _backend_plan(model, args.backend, args.threads)
    if plan.model_file is not None:  # the model's own ONNX graph under one library
        from partune.backends import registry
        from partune.runners import build_model_file
        from partune.search import model_file_data

        plan.validate(model.graph, registry.names())
        data = model_file_data(model, plan.model_file)  # quantized again where the plan says
        built = build_model_file(plan, data, model.inputs, args.threads)
    else:
        built = build_plan(plan, model.mod, model.graph)
    err = max_abs_error(built(model.inputs), model.reference)
    m = time_callable(built.prepare(model.inputs))
    shares = ", ".join(
        f"{b}: {sum(len(r.nodes) for r in plan.regions if r.backend == b)} nodes"
        for b in plan.backends
    )
    print(
        f"model      {model.name} ({len(model.graph)} nodes, fingerprint {model.graph.fingerprint})"
    )
    what = (
        plan.model_file.describe() if plan.model_file else f"{len(plan.regions)} regions ({shares})"
    )
    print(f"plan       {args.plan or 'single-backend ' + args.backend}: {what}")
    print(
        f"latency    {m.median_s * 1e3:.3f} ms median, {m.cost_s * 1e3:.3f} ms best "
        f"(IQR {m.spread_s * 1e3:.3f} ms, CPU {m.cpu_s * 1e3:.3f} ms, "
        f"{m.repeats}x{m.number} calls, {args.threads} thread(s))"
    )
    print(f"max |err|  {err:.3g} vs {model.reference_source}")
    if args.verbose:
        from partune.frontend import describe_runs

        print(describe_runs(model.passes))
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
    print(
        f"{model.name}: {len(model.graph)} nodes, batch 1, {args.threads} thread(s), "
        f"reference {model.reference_source}; x fastest = median / fastest median"
    )
    print(format_table(rows))
    return 0


def cmd_headroom(args: argparse.Namespace) -> int:
    from partune.headroom import describe, measure

    print(describe(measure(load_model(args), args.threads)))
    return 0
