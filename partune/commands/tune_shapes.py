"""``partune tune MODEL --shapes ...``: one search per tuned shape, one plan file of buckets.

Each point of ``--shapes`` (``partune.frontend.shapes``) is tuned as a job of its own, the
largest first: the model imported at that point's static shapes, its own study (the job's name
and the point), the same store, so a region whose key is equal at two points is measured once,
and the cost model learned at the larger points ranks out candidates at the smaller. The plans go
into one file (``partune.core.shapes.ShapePlans``) with the axes, the axes padding is safe
on, and the library that runs the user's file fastest, for the shapes no bucket serves. The
summary ends with the verdict per point: the plan against each peer at that shape.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

from partune.commands.common import shape_flags

# Refinement trials at each point after the largest, where a budget would refine until it
# converges: the largest point's refinement explored the plans' space; at distilbert's smaller
# points refining to convergence took 19 s a point, a third of their search.
FOLLOWING_REFINE_TRIALS = 8


def cmd_tune_shapes(args: argparse.Namespace, tune_one) -> int:
    """Tune every point of ``--shapes`` with ``tune_one`` (``cmd_tune`` on one shape), then
    write the buckets to ``args.output``."""
    from partune.core import PartuneError, Plan, ShapeBucket, ShapePlans
    from partune.frontend import pad_safe, read_file_shapes, tuning_points

    if not args.model.endswith(".onnx"):
        raise PartuneError("--shapes applies to ONNX files with symbolic axes (batch, sequence)")
    if args.input_shape:
        raise PartuneError("--shapes and --input-shape both set shapes: give --shapes only")
    shapes = read_file_shapes(args.model)
    if not shapes.axes():
        raise PartuneError(f"{args.model} has no symbolic axis: its one shape needs no --shapes")
    points = tuning_points(shapes, args.shapes)
    pad = pad_safe(shapes, tuple(a for a in (args.pad_safe or "").split(",") if a))
    buckets, seconds = [None] * len(points), [0.0] * len(points)
    # The largest point first: what the search learns there (its cost model) ranks out, at the
    # smaller points, candidates that are cheaper to measure anyway.
    order = sorted(range(len(points)), key=lambda i: -math.prod(points[i].values.values()))
    with tempfile.TemporaryDirectory(prefix="partune-buckets-") as folder:
        for n, i in enumerate(order):
            point = points[i]
            print(f"\n== shape bucket {n + 1}/{len(points)}: {point.label} ==", flush=True)
            one = copy.copy(args)
            one.input_shape = shape_flags(point.shapes)
            one.shape_label = point.label
            one.output = str(Path(folder) / f"bucket{i}.json")
            if n and one.refine_trials is None:  # "until it converges" at the largest only
                one.refine_trials = FOLLOWING_REFINE_TRIALS
            started = time.monotonic()
            if (code := tune_one(one)) != 0:
                return code
            args.probed_device = one.probed_device  # the device measured on, probed once
            seconds[i] = time.monotonic() - started
            plan = Plan.load(one.output)
            buckets[i] = ShapeBucket(point.values, tuple(point.shapes.values()), plan)
    if args.worker:
        return 0
    plans = ShapePlans(
        shapes.axes(), tuple(buckets), shapes.output_axes(), pad, fallback_library(buckets)
    )
    plans.save(args.output)
    print(bucket_table(plans, seconds))
    print(f"plan with {len(buckets)} shape buckets written to {args.output}")
    print(f"deploy it: partune export {args.model} --plan {args.output} -o DIR")
    sys.stdout.flush()
    return 0


def _library_times(plan) -> dict[str, float]:
    """The verdict's median per library peer on the user's file (f32), by library."""
    from partune.runners import LIBRARY_PEERS, peer_kind

    times = plan.notes.get("verdict_median_s", {})
    return {
        kind: s
        for label, s in times.items()
        if label in plan.notes.get("peers", []) and (kind := peer_kind(label)) in LIBRARY_PEERS
    }


def fallback_library(buckets) -> str:
    """The library that ran the user's file fastest over the tuned points (geomean of its
    medians where every point timed it), for the shapes no bucket serves."""
    from partune.core import DEFAULT_FALLBACK

    times = [_library_times(b.plan) for b in buckets]
    common = set.intersection(*(set(t) for t in times)) if times else set()
    if not common:
        return DEFAULT_FALLBACK
    return min(sorted(common), key=lambda k: sum(math.log(t[k]) for t in times))


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.3f}" if s is not None else "-"


def bucket_table(plans, seconds: list[float] | None = None) -> str:
    """The verdict per tuned point: the plan's median, each peer's at the same shape, and the
    plan against the fastest peer; the range of shapes each bucket serves, and its search time."""
    from partune.core import point_label

    peers = list(dict.fromkeys(p for b in plans.buckets for p in b.plan.notes.get("peers", [])))
    head = ["point", "serves", "plan ms", *[f"{p} ms" for p in peers], "x best peer"]
    head += ["search s"] if seconds else []
    lines = [
        "",
        "verdict per shape bucket (each timed at its own point, interleaved with the peers):",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for i, (b, span) in enumerate(zip(plans.buckets, plans.spans(), strict=True)):
        notes = b.plan.notes
        times = notes.get("verdict_median_s", {})
        ratio = notes.get("speedup_vs_best_peer")
        cells = [
            point_label(b.point),
            span,
            _ms(times.get(notes.get("chosen_as"))),
            *[_ms(times.get(p)) for p in peers],
            f"{ratio:.2f}x" if ratio else "-",
        ]
        cells += [f"{seconds[i]:.0f}"] if seconds else []
        lines.append("| " + " | ".join(cells) + " |")
    pad = ", ".join(f"{a} ({why})" for a, why in plans.pad.items()) or "none"
    lines.append(
        f"padded up to a bucket's point on: {pad}; any other shape runs your file under "
        f"{plans.fallback}"
    )
    return "\n".join(lines)
