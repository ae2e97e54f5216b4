"""Helpers every subcommand shares: reading the command line into models, shapes, durations, runners
and jobs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def setup_threads(threads: int) -> None:
    # TVM, torch and onnxruntime read these when their thread pools start.
    os.environ.setdefault("TVM_NUM_THREADS", str(threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from partune.backends import registry

    registry.set_threads(threads)


def parse_input_shapes(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """--input-shape NAME=D1,D2,... (repeatable)."""
    from partune.core import PartuneError

    shapes = {}
    for spec in specs or []:
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.replace("x", ",").split(","))
        except ValueError:
            raise PartuneError(
                f"bad --input-shape '{spec}': expected NAME=D1,D2,... e.g. input_ids=1,128"
            ) from None
        if not name or any(d < 1 for d in shapes[name]):
            raise PartuneError(
                f"bad --input-shape '{spec}': expected NAME=D1,D2,... with positive sizes"
            )
    return shapes


def shape_flags(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Input shapes as ``--input-shape`` values (``parse_input_shapes`` reads them back)."""
    return [f"{name}={','.join(map(str, dims))}" for name, dims in shapes.items()]


def load_model(args: argparse.Namespace):
    """The model named on the command line; dimensions it left open are reported."""
    from partune.frontend import load

    model = load(
        args.model, parse_input_shapes(args.input_shape), getattr(args, "disable_pass", None) or ()
    )
    for note in model.assumed:
        print(
            f"partune: note: {note} (set it with --input-shape, or tune several with --shapes)",
            file=sys.stderr,
        )
    return model


def read_samples(calibration: str, validation: str | None, model) -> tuple[tuple, tuple, str]:
    """The samples of ``--calibration`` (and ``--validation``, else the last quarter of them
    held out), each checked against the model's inputs; with a line saying how many each set
    has. Raises with one line where they do not fit."""
    from partune.frontend import load_samples, split_samples

    spec = (
        [p.name for p in model.mod["main"].params],
        [a.shape for a in model.inputs],
        [str(a.dtype) for a in model.inputs],
    )
    samples = load_samples(calibration, *spec)
    held = load_samples(validation, *spec) if validation else None
    calibrated, judged, note = split_samples(samples, held)
    return tuple(calibrated), tuple(judged), note


def parse_duration(text: str) -> float:
    """'90s', '15m', '8h', '1d' or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        from partune.core import PartuneError

        raise PartuneError(f"bad duration '{text}': use e.g. 90s, 15m, 8h") from None


def parse_pins(specs: list[str], model) -> dict:
    """--pin SELECTOR=BACKEND; SELECTOR is a node index, a range a-b, or an op name."""
    from partune.core import PartuneError, SEScope

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
    """The runner ``--runner`` names; ``cpus`` pins a local runner's worker (beside a build
    pool)."""
    from partune.core import PartuneError
    from partune.runners import LocalRunner

    if spec == "local":
        return LocalRunner(timeout_s=timeout_s, threads=threads, cpus=cpus)
    if spec.startswith("rpc://"):
        from partune.runners import RPCRunner

        address, _, key = spec[len("rpc://") :].partition("/")
        if not key:
            raise PartuneError(f"bad runner '{spec}': expected rpc://HOST:PORT/KEY")
        return RPCRunner(address, key, timeout_s=timeout_s, threads=threads)
    raise PartuneError(f"unknown runner '{spec}': use local or rpc://HOST:PORT/KEY")


def sqlite_file(storage: str) -> str | None:
    """The file of an SQLite storage URL (None for in-memory SQLite and other storages)."""
    if storage.startswith("sqlite:///") and storage != "sqlite:///:memory:":
        return storage[len("sqlite:///") :]
    return None


def beside_store(storage: str, suffix: str) -> str:
    """A path beside an SQLite store (``partune.db`` -> ``partune<suffix>``), else in the
    working directory: where the cost model and the tuning database live."""
    path = sqlite_file(storage)
    return str(Path(path).with_suffix(suffix)) if path else "partune" + suffix


def job_attrs(storage, study_name: str, required: bool = True) -> dict:
    """A tuning job's attributes (its best plan, model, input shapes); {} when there is none
    and it is not ``required``."""
    import optuna

    from partune.core import PartuneError

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


def previous_plan(storage, study_name: str):
    """The plan an earlier run of this tuning job emitted, if any."""
    from partune.core import Plan

    attrs = job_attrs(storage, study_name, required=False)
    return Plan.from_json(attrs["best_plan"]) if "best_plan" in attrs else None


def study_summaries(storage: str) -> list:
    """Every study in a storage; an unreachable or corrupt storage is one clear error."""
    import optuna

    from partune.core import PartuneError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.get_all_study_summaries(storage, include_best_trial=False)
    except Exception as e:  # noqa: BLE001 - sqlalchemy raises many kinds
        from partune.store import shown

        raise PartuneError(
            f"cannot open storage {shown(str(storage))}: {str(e).splitlines()[0][:160]}"
        ) from e


def format_duration(seconds: float) -> str:
    """3h12m, 4m05s, 12s: for people."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def is_zoo(name: str) -> bool:
    from partune.frontend import ZOO

    return name in ZOO
