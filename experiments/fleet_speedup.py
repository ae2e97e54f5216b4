"""Wall-clock speed-up of one search shared by N workers, each with a device of its own.

N ``partune rpc-server`` devices register with one TVM RPC tracker under one key, and N
``partune tune`` processes search one model on one fresh PostgreSQL database. The time
to the last worker's end is compared with N = 1; each worker's share of the candidate
measurements is reported too.

    python experiments/fleet_speedup.py [--workers 1 2 3] [--layers 8]

On loopback the devices share this machine's cores: with more workers than cores the
speed-up is capped by the machine, not by the search (the issue asks for 0.8 N only where
N is at most the number of cores). Results: experiments/results/fleet_speedup.md.
"""

from __future__ import annotations

import argparse
import os
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


def one_search(pg, model: Path, n: int, tmp: Path) -> tuple[float, list[int]]:
    """(wall seconds until the last worker ended, candidate measurements per worker)."""
    url = pg.create_database(f"fleet{n}")
    with loopback_fleet({"speed": n}) as (tracker, _):
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-m", "partune.cli", "tune", str(model), "--backends",
                                   "tvm,onnxruntime", "--peers", "none", "--refine-trials", "0", "--runner",
                                   f"rpc://{tracker}/speed", "--storage", url, "--study", "speed",
                                   "-o", str(tmp / f"p{n}{i}.json")], cwd=ROOT, env=ENV,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(n)]
        for p in procs:
            _, err = p.communicate(timeout=1800)
            if p.returncode:
                raise SystemExit(f"worker failed: {err[-300:]}")
        wall = time.monotonic() - started
    name = next(s.study_name for s in optuna.get_all_study_summaries(url) if s.study_name.startswith(STUDY_PREFIX))
    trials = optuna.load_study(study_name=name, storage=url).trials
    share = Counter(t.user_attrs["pid"] for t in trials if t.user_attrs["key"].startswith("region:"))
    return wall, sorted(share.values(), reverse=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--layers", type=int, default=8, help="MLP layers of the model searched (default 8)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as folder, local_postgres() as pg:
        tmp = Path(folder)
        model = write_mlp_onnx(tmp / "mlp.onnx", layers=args.layers)
        for n in args.workers:
            wall, share = one_search(pg, model, n, tmp)
            rows.append((n, wall, share))
            print(f"N={n}: {wall:.0f} s, candidate measurements per worker {share}", flush=True)
    base = rows[0][1]
    lines = [f"# One search, N workers and N loopback devices ({os.cpu_count()} cores)", "",
             f"`python experiments/fleet_speedup.py --workers {' '.join(map(str, args.workers))} --layers "
             f"{args.layers}`: a {args.layers}-layer MLP ONNX file, backends tvm,onnxruntime, no refinement, one "
             "fresh PostgreSQL database per N. Devices and workers share this machine's cores.", "",
             "| N | wall s | speed-up | candidate measurements per worker | largest share |", "|---|---|---|---|---|"]
    for n, wall, share in rows:
        lines.append(f"| {n} | {wall:.0f} | {base / wall:.2f}x | {share} | {max(share) / sum(share):.0%} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "experiments" / "results" / "fleet_speedup.md"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
