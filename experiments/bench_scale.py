"""Search cost against model size: ``partune tune`` on the same layer repeated 2 to 24 times.

The subjects are the scaling architectures of experiments/architectures.py (``SCALING``): a
BERT-base-width encoder (768 wide, 12 heads, seq 128) at 2, 6, 12 and 24 layers, and a full
ResNet-50. Identical layers share measurement keys (``partune.core.keys``), so what a
search measures should stop growing once the model holds every distinct region; the goal
is a 24-layer search at most 1.3x the wall time of a 12-layer one.

For each subject: export it to ONNX as a user would, run ``partune tune`` on a store of its
own (a fresh one unless ``--keep``), then, with ``--warm``, the same command again on that
store: the second run measures nothing, so its time is the search's fixed cost (import,
enumeration, keys, features, DP rounds, plan building). Writes
experiments/results/scale.md (and scale.json; rows of earlier runs are kept, a subject run
again replaces its row): nodes, candidates, distinct candidate keys, measurements, search
minutes, the warm rerun, peak RSS of the search process, and the plan against the best peer.

    python experiments/bench_scale.py                       # bert_l2 bert_l6, peers off
    python experiments/bench_scale.py bert_l12 bert_l24 resnet50 --warm   # a quiet machine, hours
    python experiments/bench_scale.py bert_l12 --peers onnxruntime,openvino --timeout 2h

On a shared machine prefix ``nice -n 19``: the tune processes inherit it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "experiments" / "results"
DEFAULT = ["bert_l2", "bert_l6"]
ORDER = ["bert_l2", "bert_l6", "bert_l12", "bert_l24", "resnet50", "efficientnet_b0"]


def _count(path: str, flags: list[str], backends: str) -> dict:
    """Nodes, candidates and distinct candidate keys of the model, as ``partune tune`` enumerates
    them (in a process of its own, so the model's memory is not the benchmark's)."""
    code = (
        "import json, sys\n"
        "from partune.backends import registry\n"
        "from partune.commands.common import parse_input_shapes\n"
        "from partune.core.keys import candidate_key\n"
        "from partune.core.scopes import CompilationConfig\n"
        "from partune.frontend.models import load\n"
        "from partune.search.candidates import enumerate_candidates\n"
        "from partune.search.dp import schedulable\n"
        "path, shapes, backends = sys.argv[1], sys.argv[2].split(';') if sys.argv[2] else [], "
        "sys.argv[3].split(',')\n"
        "m = load(path, parse_input_shapes(shapes))\n"
        "config = CompilationConfig.for_cpu(backends, 1)\n"
        "cands = [c for c in enumerate_candidates(m.mod, m.graph, config, m.pins) if "
        "schedulable(c)]\n"
        "keys = {candidate_key(m.graph, c.subgraph.nodes, c.scope) for c in cands}\n"
        "print(json.dumps({'nodes': len(m.graph), 'candidates': len(cands), 'keys': "
        "len(keys)}))\n"
    )
    shapes = ";".join(flags[i + 1] for i in range(0, len(flags), 2))
    done = subprocess.run(
        [sys.executable, "-c", code, path, shapes, backends],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return {"count_error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tune(
    path: str,
    flags: list[str],
    storage: str,
    out: Path,
    args,
    extra: tuple[str, ...] | list[str] = (),
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "partune.cli",
        "--threads",
        "1",
        *flags,
        "tune",
        path,
        "--backends",
        args.backends,
        "--storage",
        storage,
        "--peers",
        args.peers,
        "-o",
        str(out),
        *extra,
    ] + (["--timeout", args.timeout] if args.timeout else [])
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    run = {"wall_s": time.monotonic() - start, "command": " ".join(cmd[1:])}
    if done.returncode != 0:
        run["error"] = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return run
    if stats := re.search(
        r"search ([\d.]+) s; candidates (\d+); measurements made (\d+) \((\d+) failed\), "
        r"reused (\d+)",
        done.stdout,
    ):
        run |= {
            "search_s": float(stats.group(1)),
            "candidates": int(stats.group(2)),
            "measured": int(stats.group(3)),
            "failed": int(stats.group(4)),
            "reused": int(stats.group(5)),
        }
    run["timed_out"] = "stopped early at --timeout" in done.stdout
    if peak := re.search(r"peak memory: search ([\d.]+) GB", done.stdout):
        run["peak_gb"] = float(peak.group(1))
    if workers := re.search(r"measuring workers ([\d.]+) GB", done.stdout):
        run["workers_peak_gb"] = float(workers.group(1))
    notes = json.loads(out.read_text())["notes"]
    run["speedup"] = notes.get("speedup_vs_best_peer")
    run["best_peer"] = notes.get("best_peer")
    run["stdout_tail"] = done.stdout[-3000:]
    return run


def bench(name: str, args, folder: Path) -> dict:
    from experiments.bench_vs_peers import _export

    path = folder / f"{name}.onnx"
    if path.exists():  # exporting a 24-layer model takes minutes: an earlier export is reused
        path, flags = str(path), _flags(name)
    else:
        path, flags = _export(name, folder)
    row: dict = {"model": name, "date": time.strftime("%Y-%m-%d %H:%M")}
    row |= _count(path, flags, args.backends)
    db = folder / f"{name}.db"
    if not args.keep:
        db.unlink(missing_ok=True)
    storage = f"sqlite:///{db}"
    row["cold"] = _tune(path, flags, storage, folder / f"{name}.plan.json", args)
    if args.warm and "error" not in row["cold"]:
        row["warm"] = _tune(path, flags, storage, folder / f"{name}.plan.json", args)
    return row


def _flags(name: str) -> list[str]:
    """The --input-shape flags of a subject exported earlier (``bench_vs_peers._export`` gives them
    with a new export)."""
    from experiments.architectures import get

    arch = get(name)
    _, inputs = arch.build()
    flags = []
    for input_name, tensor in zip(arch.input_names, inputs, strict=True):
        flags += ["--input-shape", f"{input_name}={','.join(str(d) for d in tensor.shape)}"]
    return flags


def table(rows: list[dict]) -> str:
    head = [
        "model",
        "nodes",
        "candidates",
        "distinct candidate keys",
        "measurements",
        "search min",
        "partune tune wall min",
        "warm rerun min",
        "peak RSS (search)",
        "plan vs best peer",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cold, warm = r.get("cold", {}), r.get("warm", {})
        if "error" in cold:
            lines.append(f"| {r['model']} | failed: {cold['error']} |" + " |" * (len(head) - 2))
            continue
        speed = cold.get("speedup")
        cells = [
            r["model"],
            str(r.get("nodes", "-")),
            str(cold.get("candidates", r.get("candidates", "-"))),
            str(r.get("keys", "-")),
            str(cold.get("measured", "-")) + (" (timed out)" if cold.get("timed_out") else ""),
            f"{cold['search_s'] / 60:.1f}" if "search_s" in cold else "-",
            f"{cold['wall_s'] / 60:.1f}",
            f"{warm['wall_s'] / 60:.1f} ({warm.get('measured', '?')} measured)"
            if "wall_s" in warm
            else "-",
            f"{cold['peak_gb']:.1f} GB" if "peak_gb" in cold else "-",
            f"{speed:.2f}x ({cold.get('best_peer')})" if speed else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    by = {r["model"]: r for r in rows if "wall_s" in r.get("cold", {})}
    notes = []
    for small, big in (("bert_l2", "bert_l6"), ("bert_l6", "bert_l12"), ("bert_l12", "bert_l24")):
        if small in by and big in by:
            ratio = by[big]["cold"]["wall_s"] / by[small]["cold"]["wall_s"]
            notes.append(
                f"{big} / {small}: {ratio:.2f}x the wall time"
                + (" (goal for bert_l24 / bert_l12: at most 1.3x)" if big == "bert_l24" else "")
            )
    return "\n".join(lines + ([""] + notes if notes else []) + phases(rows))


def phases(rows: list[dict]) -> list[str]:
    """The cold searches' "time by phase" summary lines, one row a model (seconds)."""
    found = {}
    for r in rows:
        line = re.search(r"time by phase: (.*)", r.get("cold", {}).get("stdout_tail", ""))
        if line:
            found[r["model"]] = {
                m.group(1): float(m.group(2))
                for m in re.finditer(r"(.+?) ([\d.]+) s(?:, |$)", line.group(1))
            }
    if not found:
        return []
    names = list(dict.fromkeys(name.strip() for p in found.values() for name in p))
    lines = [
        "",
        'Cold search by phase (s, the summary\'s "time by phase" line):',
        "",
        "| model | " + " | ".join(names) + " |",
        "|" + "|".join("---" for _ in range(len(names) + 1)) + "|",
    ]
    for model, p in found.items():
        p = {k.strip(): v for k, v in p.items()}
        lines.append(
            f"| {model} | " + " | ".join(f"{p[n]:.0f}" if n in p else "-" for n in names) + " |"
        )
    return lines


# a section written by hand (profiles): kept when the table is rewritten
KEPT = "## Where the time goes"


def _kept(path: Path) -> str:
    text = path.read_text() if path.exists() else ""
    return "\n" + text[text.index(KEPT) :] if KEPT in text else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models",
        nargs="*",
        help=f"scaling subjects (default: {' '.join(DEFAULT)}; all: {' '.join(ORDER)})",
    )
    p.add_argument("--backends", default="tvm,torch,onnxruntime,openvino")
    p.add_argument(
        "--peers",
        default="none",
        help="peers of the verdict (default none: the plan column is '-')",
    )
    p.add_argument(
        "--timeout",
        help="partune tune --timeout: a budget to spend (default none: the default "
        "search, whose work is fixed)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="run each search a second time on its store (fixed costs)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep each subject's store from an earlier run (default: fresh)",
    )
    p.add_argument("--folder", default="/tmp/partune-scale", help="ONNX exports, stores and plans")
    p.add_argument("--out", default=str(RESULTS / "scale.md"))
    p.add_argument(
        "--render", action="store_true", help="only write the report again from its .json"
    )
    args = p.parse_args(argv)
    raw = Path(args.out).with_suffix(".json")
    if args.render:
        Path(args.out).write_text(
            HEADER + table(json.loads(raw.read_text())) + "\n" + FOOTER + _kept(Path(args.out))
        )
        return 0
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = {r["model"]: r for r in json.loads(raw.read_text())} if raw.exists() else {}
    for name in args.models or DEFAULT:
        row = bench(name, args, folder)
        rows[name] = row
        print(
            json.dumps({k: v for k, v in row.items() if k not in ("cold", "warm")}),
            {
                k: {x: y for x, y in row[k].items() if x not in ("stdout_tail", "command")}
                for k in ("cold", "warm")
                if k in row
            },
            flush=True,
        )
        ordered = sorted(
            rows.values(), key=lambda r: ORDER.index(r["model"]) if r["model"] in ORDER else 99
        )
        raw.write_text(json.dumps(ordered, indent=1))
        Path(args.out).write_text(HEADER + table(ordered) + "\n" + FOOTER + _kept(Path(args.out)))
    return 0


HEADER = """# Search cost against model size

`experiments/bench_scale.py`: `partune tune` (all four backends, 1 thread, a fresh SQLite store per
model) on a BERT-base-width encoder (768 wide, 12 heads, FFN 3072, seq 128) at 2, 6, 12 and 24
layers, and ResNet-50. *search min*: the search as the summary times it; *partune tune wall min*:
the whole command, model import included; *warm rerun*: the same command again on its store,
which measures nothing (the search's fixed costs). Peak RSS is the search process's own (the
summary's "peak memory" line); the measuring workers are not in it.

"""

FOOTER = """
Rows still to run (a quiet machine; hours for the 12- and 24-layer searches; at about 1 GB of
search-process RSS per layer today, bert_l24 needs more than this 23 GB machine):

    nice -n 19 .venv/bin/python experiments/bench_scale.py bert_l12 bert_l24 resnet50 --warm

Each row replaces an earlier row of the same model; `--peers onnxruntime,openvino` fills the last \
column.
"""


if __name__ == "__main__":
    raise SystemExit(main())
