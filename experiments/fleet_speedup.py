"""Wall-clock speed-up of one search shared by N workers, each with a device of its own.

N ``partune rpc-server`` devices register with one TVM RPC tracker under one key, and N
``partune tune`` processes search one model on one fresh PostgreSQL database, with the same
settings for every N. The time to the last worker's end is compared with N = 1; each
worker's share of the candidate measurements is reported, and where the last worker's
time went (``partune tune`` prints its time by phase).

    python experiments/fleet_speedup.py [--workers 1 2 3] [--models mlp resnet50-small] \\
        [--layers 8] [--repeats 3]

Models: ``mlp`` (an MLP ONNX file of ``--layers`` identical layers: few distinct candidates,
so the part of the search every worker goes through whatever N dominates it) and zoo names,
exported once to ONNX as a user would (``torch.onnx.export``), outside the timing.

On loopback the devices share this machine's cores with the workers, the tracker and
PostgreSQL: with more workers than cores the speed-up is capped by the machine, not by the
search. The issue asks for at least 0.8 N only where N is at most the number of cores; that
is checked for the ``--check`` models (exit status 1 when it does not hold).
Results: experiments/results/fleet_speedup.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from tests.fleet import ENV, loopback_fleet  # noqa: E402
from tests.model_files import write_mlp_onnx  # noqa: E402
from tests.postgres import local_postgres  # noqa: E402

STUDY_PREFIX = "partune-measurements/"
SETTINGS = ["--backends", "tvm,onnxruntime", "--peers", "none", "--refine-trials", "0"]
PHASES = {
    "start-up": "start-up",
    "calibrate": "calibrate",
    "capture": "capture",
    "measure candidates": "candidates",
    "measure plans": "plans",
    "refine": "refine",
    "plans vs peers": "verdict",
}


def model_file(name: str, layers: int, folder: Path) -> Path:
    """The ONNX file searched: the MLP, or a zoo model exported the way a user would."""
    if name == "mlp":
        return write_mlp_onnx(folder / "mlp.onnx", layers=layers)
    from partune.frontend.zoo import ZOO
    from partune.runners.peers import onnx_export

    entry = ZOO[name]
    path = folder / f"{name}.onnx"
    path.write_bytes(onnx_export(entry.build(), [x.numpy() for x in entry.inputs()]))
    return path


def fresh_storage(pg, name: str) -> str:
    """A fresh, empty database, its tables made before the workers start: workers that open
    an empty database together race to create them, and a lost race (DuplicateTable) ends
    a worker (reported separately; not what is measured here)."""
    from partune.store.sql_claims import SqlClaims

    url = pg.create_database(name)
    storage = optuna.storages.RDBStorage(url)
    SqlClaims(storage.engine)
    storage.engine.dispose()
    return url


def phases(stdout: str) -> dict[str, float]:
    """A ``partune tune`` job's "time by phase" line, short names -> seconds."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("time by phase: ")), "")
    out: dict[str, float] = {}
    for name, seconds in re.findall(r"(.+?) (\d+\.\d+) s(?:; |$)", line[len("time by phase: ") :]):
        short = next((v for k, v in PHASES.items() if name.startswith(k)), "other")
        out[short] = out.get(short, 0.0) + float(seconds)
    return out


def busy_s() -> float:
    """CPU seconds this machine has been busy (all cores, since boot)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf(
        "SC_CLK_TCK"
    )  # not idle, not iowait


def tree_s(*roots: int) -> float:
    """CPU seconds of these processes and their descendants, the live ones and those they reaped."""
    tick, total, pids = os.sysconf("SC_CLK_TCK"), 0.0, list(roots)
    while pids:
        pid = pids.pop()
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            pids += [
                int(c)
                for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()
            ]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += sum(int(x) for x in f[11:15]) / tick  # utime, stime, and its reaped children's
    return total


def postgres_s(pg) -> float:
    """CPU seconds of the PostgreSQL server: its postmaster and its backends."""
    return tree_s(int(Path(pg.data, "postmaster.pid").read_text().split()[0]))


def one_search(pg, model: Path, n: int, tmp: Path, run: int = 0) -> dict:
    """One search by ``n`` workers: its wall seconds (until the last worker ended), candidate
    measurements per worker, the last worker's time by phase, and the CPU seconds spent
    meanwhile by the workers, by the devices, by PostgreSQL and by everything else on the
    machine, the tracker included (other work would make the timings wrong)."""
    url = fresh_storage(pg, re.sub(r"\W", "_", f"fleet_{model.stem}_{n}_{run}").lower())
    with loopback_fleet({"speed": n}) as (tracker, servers):
        logs = [
            (open(tmp / f"w{n}{i}.out", "w+"), open(tmp / f"w{n}{i}.err", "w+")) for i in range(n)
        ]
        devices = [s.pid for s in servers["speed"]]
        busy0, pg0, devices0 = busy_s(), postgres_s(pg), tree_s(*devices)
        started = time.monotonic()
        # Output to files, not pipes: a pipe nobody reads yet fills and stalls its worker.
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "partune.cli",
                    "tune",
                    str(model),
                    *SETTINGS,
                    "--runner",
                    f"rpc://{tracker}/speed",
                    "--storage",
                    url,
                    "--study",
                    "speed",
                    "-o",
                    str(tmp / f"p{n}{i}.json"),
                ],
                cwd=ROOT,
                env=ENV,
                stdout=out,
                stderr=err,
                text=True,
            )
            for i, (out, err) in enumerate(logs)
        ]
        ended: dict[int, float] = {}  # worker -> when it was seen to have ended
        workers_s = 0.0
        while len(ended) < n:
            time.sleep(0.1)
            for i, proc in enumerate(procs):
                if i in ended:
                    continue
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid == 0:
                    continue
                ended[i], proc.returncode = time.monotonic(), os.waitstatus_to_exitcode(status)
                workers_s += ru.ru_utime + ru.ru_stime
                if proc.returncode:
                    logs[i][1].seek(0)
                    raise SystemExit(f"worker failed: {logs[i][1].read()[-600:]}")
        wall = max(ended.values()) - started
        busy, pg_s, devices_s = busy_s() - busy0, postgres_s(pg) - pg0, tree_s(*devices) - devices0
    last = max(ended, key=ended.get)
    logs[last][0].seek(0)
    spent = phases(logs[last][0].read())
    for out, err in logs:
        out.close()
        err.close()
    name = next(
        s.study_name
        for s in optuna.get_all_study_summaries(url)
        if s.study_name.startswith(STUDY_PREFIX)
    )
    trials = optuna.load_study(study_name=name, storage=url).trials
    keys = [t.user_attrs["key"] for t in trials]
    if len(keys) != len(set(keys)):
        raise SystemExit("a key was measured twice")
    share = Counter(
        t.user_attrs["pid"] for t in trials if t.user_attrs["key"].startswith("region:")
    )
    cpu = {
        "workers": workers_s,
        "devices": devices_s,
        "postgres": pg_s,
        "other": max(busy - workers_s - devices_s - pg_s, 0.0),
    }
    return {
        "n": n,
        "wall": wall,
        "share": sorted(share.values(), reverse=True),
        "phases": spent,
        "cpu": cpu,
    }


def table(model: str, rows: list[dict], cores: int) -> list[str]:
    base = rows[0]["wall"]
    lines = [
        f"### {model}",
        "",
        "| N | wall s | speed-up | candidate measurements per worker | largest share "
        "| the last worker's time by phase, s | CPU s: workers, devices, PostgreSQL, other "
        "| cores busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        when = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items() if v >= 0.05)
        cpu = r["cpu"]
        lines.append(
            f"| {r['n']} | {r['wall']:.0f} | {base / r['wall']:.2f}x | {r['share']} "
            f"| {max(r['share']) / sum(r['share']):.0%} | {when} | "
            + ", ".join(f"{cpu[k]:.0f}" for k in ("workers", "devices", "postgres", "other"))
            + f" | {sum(cpu.values()) / r['wall']:.2f} of {cores} |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2, 3], help="the first is the baseline"
    )
    p.add_argument(
        "--models", nargs="+", default=["mlp", "resnet50-small"], help="mlp and/or zoo names"
    )
    p.add_argument("--layers", type=int, default=8, help="MLP layers (default 8)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="searches per N; the one of median wall is reported "
        "(one search varied 1.52x-1.72x at N = 2 between runs)",
    )
    p.add_argument(
        "--check",
        nargs="*",
        default=["resnet50-small"],
        help="models whose speed-up must be at least 0.8 N wherever N <= the cores",
    )
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cores, results = os.cpu_count() or 1, {}
    with tempfile.TemporaryDirectory() as folder, local_postgres() as pg:
        tmp = Path(folder)
        for name in args.models:
            model = model_file(name, args.layers, tmp)
            rows = results[name] = []
            for n in args.workers:
                runs = []
                for run in range(args.repeats):
                    runs.append(one_search(pg, model, n, tmp, run))
                    r = runs[-1]
                    print(
                        f"{name} N={n}: {r['wall']:.0f} s, candidates per worker {r['share']}, "
                        f"last worker { {k: round(v, 1) for k, v in r['phases'].items()} }, CPU s "
                        f"{ {k: round(v) for k, v in r['cpu'].items()} }",
                        flush=True,
                    )
                rows.append(sorted(runs, key=lambda r: r["wall"])[len(runs) // 2])
    failed = [
        f"{name} N={r['n']}: {rows[0]['wall'] / r['wall']:.2f}x < {0.8 * r['n']:.1f}x"
        for name, rows in results.items()
        if name in args.check
        for r in rows
        if 1 < r["n"] <= cores and rows[0]["wall"] / r["wall"] < 0.8 * r["n"]
    ]
    lines = [
        f"# One search, N workers and N loopback devices ({cores} cores)",
        "",
        f"`python experiments/fleet_speedup.py --workers {' '.join(map(str, args.workers))} "
        f"--models {' '.join(args.models)} --layers {args.layers} --repeats {args.repeats}`: each "
        f"model as an ONNX file, `{' '.join(SETTINGS)}`, the same for every N; one fresh "
        f"PostgreSQL database per search; of {args.repeats} search(es) per N, the one of median "
        "wall time. Devices, workers, the tracker and PostgreSQL share this machine's cores; CPU "
        's "other" is what the rest of the machine (the tracker included) used meanwhile.',
        "",
    ]
    for name, rows in results.items():
        lines += table(name if name != "mlp" else f"mlp ({args.layers} layers)", rows, cores)
    checked = [m for m in args.check if m in results]
    if checked:
        lines.append(
            f"At least 0.8 N where N <= {cores} cores ({', '.join(checked)}): "
            + ("; ".join(failed) if failed else "holds")
            + "."
        )
    text = "\n".join(lines) + "\n"
    out = ROOT / "experiments" / "results" / "fleet_speedup.md"
    out.write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
