"""The ``partune`` command line: run a model under a plan, benchmark plans against peers.

Bad input (unknown model, unreadable file, a plan that does not fit) is reported as one
line on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from partune.commands.common import setup_threads
from partune.commands.dashboard import cmd_dashboard
from partune.commands.explain import cmd_explain
from partune.commands.jobs import (
    cmd_backends,
    cmd_costmodel_eval,
    cmd_export,
    cmd_models,
    cmd_report,
    cmd_rpc_server,
    cmd_status,
)
from partune.commands.run import cmd_bench, cmd_headroom, cmd_run
from partune.commands.tune import cmd_tune

EXIT_USAGE = 2


def _pass_options(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument(
        "--disable-pass",
        action="append",
        metavar="NAME",
        default=default,
        help="leave this import pass out (repeatable; see --list-passes); a plan "
        "is made for the module its passes produce, so export with the same",
    )


class _ListPasses(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from partune.frontend import describe_passes

        print(describe_passes())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="partune",
        description="Decide which backend runs which part of a deep-learning model, by measuring.",
        epilog="MODEL is a zoo name (see `partune models`) or a path to an .onnx, .pt2 "
        "(torch ExportedProgram) or TVMScript (.py/.tvmscript/.relax) file.",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for every backend and peer (default 1: the stable setting on small machines)",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=D1,D2,...",
        help="static shape for an ONNX input whose dimensions are symbolic, e.g. "
        "input_ids=1,128 (repeatable; open dimensions default to 1)",
    )
    _pass_options(p, None)
    p.add_argument(
        "--list-passes",
        action=_ListPasses,
        nargs=0,
        help="list the import passes every model goes through, in order, and exit",
    )
    p.add_argument(
        "--tvm-database",
        metavar="DIR",
        help="a MetaSchedule JSON database: the tvm backend applies its tuned schedules",
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "run", help="run a model under a plan, or a deploy directory; print latency and error"
    )
    r.add_argument(
        "model",
        metavar="MODEL",
        help="a model (zoo name or file), or a directory from `partune export`",
    )
    g = r.add_mutually_exclusive_group()
    g.add_argument("--plan", help="a plan JSON file (from `partune tune` or --save-plan)")
    g.add_argument(
        "--backend",
        default="tvm",
        help="single-backend plan: all this backend accepts, the rest to tvm (default tvm)",
    )
    r.add_argument("--save-plan", metavar="FILE", help="write the plan that was run as JSON")
    r.add_argument(
        "--input",
        action="append",
        metavar="X.npy",
        help=(
            "for a deploy directory: an input array (repeat per input; default: the example inputs)"
        ),
    )
    r.add_argument(
        "--output", metavar="PREFIX", help="for a deploy directory: save outputs as PREFIX_i.npy"
    )
    r.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print each import pass's time and how many places it rewrote",
    )
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="time each single-backend plan and the usual peers in one run")
    b.add_argument("model", metavar="MODEL")
    b.add_argument(
        "--backends", help="comma-separated backends for single-backend plans (default: all)"
    )
    b.add_argument(
        "--peers",
        help="comma-separated peers: torch,torch.compile,onnxruntime,openvino (default: all)",
    )
    b.set_defaults(func=cmd_bench)

    h = sub.add_parser(
        "headroom",
        help="how much any plan could gain over onnxruntime and OpenVINO, in seconds",
        description="Before an overnight search: time onnxruntime and OpenVINO on the model's "
        "ONNX graph (your file, or torch.onnx.export of a zoo model), count the FLOPs of its "
        "convolutions and matmuls, and measure this core's f32 GEMM peak. No f32 plan runs "
        "that arithmetic faster than the peak, so the faster library's time over it bounds "
        "what any plan can gain; OpenVINO's per-layer counters tighten the bound to what is "
        "left outside its GEMM kernels. Near 1.0x, the library already runs the model at "
        "about the core's speed and a search can hardly win.",
    )
    h.add_argument("model", metavar="MODEL")
    h.set_defaults(func=cmd_headroom)

    t = sub.add_parser(
        "tune",
        help="search the fastest partitioning (Collage DP on measured candidates)",
        description="Enumerate candidate regions per backend, measure each once on the values "
        "it sees inside the model (stored in Optuna storage and reused by every later "
        "run; a cost model learnt from earlier runs leaves out the candidates it ranks "
        "hopeless), pick the cheapest cover by DP, measure it and every single-backend "
        "plan end to end, learn border costs and let the DP propose again, refine with "
        "Optuna, then time the finalists against onnxruntime and OpenVINO on your model "
        "file and torch.compile, interleaved, and write the fastest plan, saying how it "
        "stands (your own file under a library, where nothing beats it). Interrupt and "
        "rerun to resume.",
    )
    t.add_argument("model", metavar="MODEL")
    _pass_options(
        t, argparse.SUPPRESS
    )  # also after the subcommand: partune tune MODEL --disable-pass NAME
    t.add_argument(
        "--backends",
        default="tvm,torch,onnxruntime,openvino",
        help="comma-separated backends on offer (default tvm,torch,onnxruntime,openvino)",
    )
    t.add_argument(
        "--storage",
        default="sqlite:///partune.db",
        help="Optuna storage URL for measurements (default sqlite:///partune.db; "
        "postgresql://... for many workers; 'memory' keeps nothing after the run)",
    )
    t.add_argument(
        "--study", help="name of this tuning job in the storage (default MODEL:BACKENDS)"
    )
    t.add_argument(
        "--runner", default="local", help="local, or rpc://HOST:PORT/KEY for a TVM RPC tracker"
    )
    t.add_argument(
        "--timeout",
        help="time budget of the search (e.g. 30m, 8h), spent where the search "
        "expects gains: after the candidates, refinement runs until it converges (no faster "
        "variant in 16 trials) unless --refine-trials is given; budgets of 30m or more also "
        "tune TVM regions (tvm-tuned) with half the time left unless --tune-budget is given; "
        "the last 10%% (at least 1 minute) is kept for the plans to meet the peers, then "
        "the fastest is written. Without it, the search does a fixed amount of work",
    )
    t.add_argument(
        "--measure-timeout",
        default="120s",
        help="limit for one measurement; a hang costs that candidate (default 120s)",
    )
    t.add_argument(
        "--pin",
        action="append",
        metavar="SELECTOR=BACKEND",
        help="keep nodes on a backend: a node index, a range a-b, or an op name (repeatable)",
    )
    t.add_argument(
        "--n-trials",
        "--refine-trials",
        dest="refine_trials",
        type=int,
        default=None,
        metavar="N",
        help="after the DP: the refinement study holds N plan variants (move a region to "
        "another backend, merge neighbours), proposed by Optuna and measured end to end; "
        "resumable, shared by all workers; 0 to skip (default 8; with --timeout, until it "
        "converges or the budget is spent)",
    )
    t.add_argument(
        "--objective",
        choices=("latency", "latency+memory"),
        default="latency",
        help="what refinement minimises: latency (TPE), or latency and peak memory "
        "(NSGA-II; each variant measured in a fresh process; the Pareto front is "
        "reported and written as PLAN.frontN.json)",
    )
    t.add_argument(
        "--build-pool",
        choices=("auto", "off"),
        default="auto",
        help="auto: with the local runner and a core to spare, candidates are built ahead "
        "of their timing on the other cores while the measurements keep a core of "
        "their own (about 1.2-1.3x faster candidate measuring on 2 cores); off: the "
        "measuring worker builds each candidate itself (default auto)",
    )
    t.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="N processes share this search (claimed measurements, one Optuna study): "
        "worth it with an RPC runner or many cores; on a small machine parallel "
        "timing is noisy (default 1). Separate `partune tune` runs on one --storage "
        "share the work the same way",
    )
    t.add_argument(
        "--heartbeat",
        type=int,
        default=60,
        metavar="S",
        help="refinement trials beat every S seconds; a trial silent for 2S (a killed "
        "worker) is failed and retried (default 60)",
    )
    t.add_argument(
        "--retry-failed",
        action="store_true",
        help="measure again, once, what the store holds as failed (after fixing a backend, "
        "or when the failure was the machine's); by default a failure is final",
    )
    t.add_argument(
        "--worker", action="store_true", help=argparse.SUPPRESS
    )  # a helper started by --workers
    t.add_argument(
        "--tune-budget",
        metavar="DURATION",
        help="auto-tune TVM regions with MetaSchedule for this long in all (e.g. 20m), most "
        "expected gain first (regions whose untuned TVM time, divided by what tuning "
        "usually buys, would beat the best other backend); adds the tvm-tuned backend. "
        "Records persist beside the storage (PLAN_DB.tuning/) and serve every later run",
    )
    t.add_argument(
        "--tune-trials",
        type=int,
        default=32,
        metavar="N",
        help="MetaSchedule trials per tuned region (default 32)",
    )
    t.add_argument(
        "--cost-model",
        metavar="auto|FILE|off",
        default="auto",
        help="rank candidates with an XGBoost cost model so fewer are measured. auto (the "
        "default): the one kept beside an SQLite storage (PLAN_DB.costmodel.json; in a PostgreSQL "
        "storage, inside it, shared by its workers); FILE: that one (see `partune costmodel eval "
        "--save`); off: measure every candidate. Of the candidates not yet stored, the one it "
        "predicts cheapest at each DP frontier (the candidates starting at one node) is measured "
        "up front, plus 5%% of all the others drawn at random; the model is refit on them, and "
        "the DP prices the rest by prediction, measuring any predicted region it picks before a "
        "plan is built on it. Where the file does not exist yet, every candidate is measured and "
        "the model is created from them; every run teaches it what it measured. On three exports "
        "it was trained without (experiments/results/cost_model_search_exports.md) it measured "
        "1.5x-3.7x fewer candidates for plans within 0.3%% of measuring everything",
    )
    t.add_argument(
        "--precision",
        choices=("f32", "bf16", "int8"),
        default="f32",
        help="f32: every region computes in f32, as the model does (default). bf16: regions "
        "may compute in bfloat16 where a backend has a real bf16 path (openvino, torch, tvm) and "
        "this CPU has bf16 instructions, each kept only where it measures faster, and "
        "no plan whose error exceeds --tolerance is emitted. int8: regions may also run their "
        "matmuls and convolutions in int8 (onnxruntime, openvino; weights per channel, "
        "activations over ranges calibrated once on the model's inputs and draws like them), "
        "bf16 where the CPU has it, or f32, whichever measures fastest within --tolerance",
    )
    t.add_argument(
        "--tolerance",
        type=float,
        default=1e-2,
        metavar="REL",
        help="with --precision bf16 or int8: the largest relative error (||y - y_f32|| / "
        "||y_f32||, "
        "worst output) a plan may have against the model in f32, on the model's inputs "
        "and on a second seeded input set the search never uses (default 0.01)",
    )
    t.add_argument(
        "--calibration",
        metavar="PATH",
        help="with --precision int8 or bf16: your samples, a folder of .npz files (one a "
        "sample, an array per input name; .npy for a one-input model) or one .npz of samples "
        "stacked on a leading axis. int8 ranges are calibrated on them and, without "
        "--validation, the last quarter is held out to judge errors on. Without it, the "
        "model's inputs and draws like them are used, and the summary says so",
    )
    t.add_argument(
        "--validation",
        metavar="PATH",
        help="samples (as --calibration) that the search never calibrates on: every plan's "
        "and peer's error is judged on them",
    )
    t.add_argument(
        "--metric",
        choices=("rel", "cosine", "top1"),
        default="rel",
        help="how errors are judged against f32, bounded by --tolerance: rel (||y - y_f32|| / "
        "||y_f32||, worst output and sample; the default), cosine (1 - cosine similarity, worst "
        "sample), top1 (the share of rows whose top class, the first output's last axis, "
        "differs: --tolerance 0.01 is 99%% agreement)",
    )
    t.add_argument(
        "--fewer-threads",
        choices=("on", "off"),
        default="on",
        help="with --threads above 1: on (default) also offers each onnxruntime and openvino "
        "region, and each of them whole, on one thread, kept only where that measures "
        "faster (small regions and small models often do: every op pays to wake and join "
        "a thread pool). off: every region runs on --threads threads",
    )
    t.add_argument(
        "--peers",
        default="onnxruntime,openvino,torch.compile",
        help="the tools you would use instead, timed against the finalist plans in one "
        "process, interleaved: onnxruntime and openvino (f32, latency, same threads) on "
        "your ONNX file (or a torch.onnx.export, or the Relax module's ONNX translation), "
        "torch.compile, torch; 'none' to skip. With --precision bf16 or int8 their bf16 and "
        "int8 peers come too ('openvino bf16', 'onnxruntime int8', 'openvino int8', "
        "'openvino int8 accuracy-control'), unless you name some of them: then exactly "
        "those (NNCF's accuracy control can take hours). When a library on your file beats "
        "every partitioned plan, that is the plan emitted (default "
        "onnxruntime,openvino,torch.compile)",
    )
    t.add_argument(
        "--shapes",
        metavar="AXIS=N,N,...;...",
        help="the shapes you serve, for an ONNX file with symbolic axes: the points to tune "
        "each axis at, e.g. 'sequence=32,128,384' or 'sequence=16,64;batch=1,8' (every "
        "combination is tuned, one plan each), or INPUT=D1,D2,... for one input's whole shape. "
        "The plan file then holds one plan per point, and its export serves the whole range: a "
        "call runs the plan of its shape, padded up to the next point where padding is safe, "
        "else your file under its fastest library. Without it, a symbolic sequence is tuned at "
        "128 and any other open dimension at 1",
    )
    t.add_argument(
        "--pad-safe",
        metavar="AXIS,...",
        help="with --shapes: axes on which padding a call up to a tuned point leaves the real "
        "positions' outputs unchanged (a causal decoder's sequence; a batch whose samples do not "
        "mix). A sequence axis that an attention-mask input carries is padded without asking",
    )
    t.add_argument(
        "-o", "--output", default="plan.json", help="where to write the plan (default plan.json)"
    )
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser(
        "export",
        help="write a deploy directory: compiled model, plan, manifest",
        description="Compile MODEL under a plan (--plan FILE, or the best plan of a tuning "
        "study) into a directory that `partune run DIR` or partune.deployed.load(DIR) runs "
        "with no search code. Files are checksummed; a changed file or a different "
        "environment is refused at load time.",
    )
    e.add_argument(
        "model", metavar="MODEL", nargs="?", help="the model (default: the one the study tuned)"
    )
    e.add_argument("--plan", help="a plan JSON file")
    e.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage of the study")
    e.add_argument(
        "--study", help="the tuning job whose best plan to export (see `partune tune --study`)"
    )
    e.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="the deploy directory to write"
    )
    e.add_argument(
        "--calibration",
        metavar="PATH",
        help="where the plan runs a file an int8 tool quantized (an int8 peer won the verdict): "
        "the --calibration samples the tuning job had, so the file is quantized again exactly "
        "as it was timed (default: the job's, for --study)",
    )
    e.add_argument(
        "--validation", metavar="PATH", help="likewise the tuning job's --validation samples"
    )
    e.set_defaults(func=cmd_export)

    rp = sub.add_parser("report", help="write a Markdown report with plots for one tuning job")
    rp.add_argument("--storage", default="sqlite:///partune.db", help="Optuna storage of the study")
    rp.add_argument("--study", required=True, help="the tuning job (see `partune status`)")
    rp.add_argument(
        "-o", "--output", required=True, metavar="DIR", help="where report.md and the PNGs go"
    )
    rp.set_defaults(func=cmd_report)

    ex = sub.add_parser(
        "explain",
        help="why each region of a plan went where it went: candidates, margins, peers",
        description="For each region of a tuning job's emitted plan (or a plan file): its ops, "
        "every backend's stored measurement of exactly those nodes, the margin over the "
        "runner-up, why each other backend lost (does not accept an op, failed, or slower "
        "by how much), the border costs the DP charged, and the plan against the peers. "
        "It reads the storage and measures nothing.",
    )
    ex.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="the model (default: the one the study tuned, or the one the plan names)",
    )
    ex.add_argument("--plan", help="a plan JSON file (instead of --study)")
    ex.add_argument(
        "--storage",
        default="sqlite:///partune.db",
        help="Optuna storage of the study and the measurements (default sqlite:///partune.db)",
    )
    ex.add_argument("--study", help="the tuning job whose plan to explain (see `partune status`)")
    ex.add_argument(
        "--device",
        help="device fingerprint of the measurements (default: this machine at the "
        "plan's thread count)",
    )
    ex.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ex.set_defaults(func=cmd_explain)

    cm = sub.add_parser(
        "costmodel", help="the XGBoost cost model learned from the measurement store"
    )
    cms = cm.add_subparsers(dest="action", required=True)
    ev = cms.add_parser(
        "eval",
        help="leave-one-model-out Spearman and top-1/top-3 recall per DP frontier",
        description="For each model measured in the store, train the cost model on the "
        "other models' measurements and score how it ranks the candidates of each DP "
        "frontier (the candidates starting at one node) of the held-out model.",
    )
    ev.add_argument(
        "--storage", default="sqlite:///partune.db", help="Optuna storage of the measurements"
    )
    ev.add_argument(
        "--models",
        help="comma-separated models (zoo names or files) to evaluate on "
        "(default: every zoo model measured in the store)",
    )
    ev.add_argument(
        "--backends", default="tvm,torch,onnxruntime,openvino", help="backends the searches offered"
    )
    ev.add_argument(
        "--device", help="device fingerprint of the measurements (default: the one with most)"
    )
    ev.add_argument(
        "--save", metavar="FILE", help="also train on everything and save the model (XGBoost JSON)"
    )
    ev.set_defaults(func=cmd_costmodel_eval)

    st = sub.add_parser(
        "status", help="list the tuning jobs in a storage and how their plans stand"
    )
    st.add_argument(
        "--storage",
        default="sqlite:///partune.db",
        help="Optuna storage URL (default sqlite:///partune.db)",
    )
    st.set_defaults(func=cmd_status)

    db = sub.add_parser(
        "dashboard",
        help="optuna-dashboard over a storage: the refinement studies' trials, "
        "parameters and history",
        description="Start optuna-dashboard on 127.0.0.1 (this machine only) over the storage "
        "and print the URL to open. Each tuning job's refinement study is there: every plan "
        "variant measured end to end (a trial), the backend it gave each region and the "
        "merges it made (its parameters), and the best time over the trials (the history). "
        "The measurement studies (partune-measurements/DEVICE, one per device, a trial per "
        "measurement) stay listed: they are few. Ctrl-C stops the server.",
    )
    db.add_argument(
        "--storage",
        default="sqlite:///partune.db",
        help="Optuna storage URL (default sqlite:///partune.db)",
    )
    db.add_argument(
        "--port", type=int, default=8080, help="port on 127.0.0.1 (default 8080; 0: any free port)"
    )
    db.set_defaults(func=cmd_dashboard)

    s = sub.add_parser("rpc-server", help="serve measurements to `partune tune --runner rpc://...`")
    s.add_argument(
        "--tracker", required=True, metavar="HOST:PORT", help="the TVM RPC tracker to register with"
    )
    s.add_argument("--key", required=True, help="device key clients ask the tracker for")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only). Requests are JSON "
        "and nothing is unpickled, but whoever reaches the port can make this machine build "
        "and run models it sends (ONNX files, zoo names, .pt2 archives): expose it only on "
        "a network you trust, e.g. --host 0.0.0.0 on a private lab subnet",
    )
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
            print(
                f"partune: error: --tvm-database {args.tvm_database} is not a directory",
                file=sys.stderr,
            )
            return EXIT_USAGE
        from dataclasses import replace

        from partune.backends import registry

        registry.configure(
            replace(registry.settings(), tvm_database=os.path.abspath(args.tvm_database))
        )
    setup_threads(args.threads)
    try:
        if getattr(args, "storage", None):  # every subcommand reads the storage URL the same way
            from partune.store import with_driver

            args.storage = with_driver(args.storage)
        return args.func(args)
    except KeyboardInterrupt:
        print(
            "partune: interrupted (measurements taken so far are kept; rerun to resume)",
            file=sys.stderr,
        )
        return 130
    except Exception as e:
        if _is_bad_input(e):
            print(f"partune: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("PARTUNE_DEBUG"):  # a bug, not bad input: still one line, unless asked
            raise
        last = (str(e).strip().splitlines() or [""])[-1][:300]
        print(
            f"partune: internal error: {type(e).__name__}: {last} "
            "(PARTUNE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _is_bad_input(e: Exception) -> bool:
    """Errors that mean bad input (each carries a one-line message), not a bug."""
    from partune.backends import ModelFileError, UnknownBackendError
    from partune.core import PartuneError
    from partune.deployed import DeployError

    return isinstance(e, (PartuneError, UnknownBackendError, DeployError, ModelFileError))


if __name__ == "__main__":
    sys.exit(main())
