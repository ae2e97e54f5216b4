"""What ``partune tune`` prints when it is done: the plan, the search, and the verdict against the
peers."""

from __future__ import annotations

from partune.core import clean_error
from partune.search import NOT_MEASURED, PATIENCE

NOISE = 0.03  # ratios closer to 1 than this are ties: run-to-run noise of interleaved medians


def summarise(result, model) -> str:
    """The closing summary: where time goes per backend, the plan against the others."""
    plan = result.plan
    lines = [
        f"plan for {model.name}: {plan.notes.get('chosen_as')}, "
        f"{plan.notes['measured_s'] * 1e3:.3f} ms measured end to end"
    ]
    if model.assumed:  # the file left dimensions open: say which shape the plan is for
        lines.append(
            "tuned at shapes assumed for the file's open dimensions: "
            + "; ".join(model.assumed)
            + " (--input-shape sets one shape, --shapes several)"
        )
    if result.dp_label is not None and result.dp_estimate_s is not None:
        measured = result.end_to_end.get(result.dp_label)
        est = result.dp_estimate_s * 1e3
        err = (
            f" ({result.dp_estimate_s / measured.cost_s - 1:+.0%})"
            if measured and measured.ok
            else ""
        )
        lines.append(
            f"DP estimate {est:.3f} ms vs measured "
            + (f"{measured.cost_s * 1e3:.3f} ms{err}" if measured and measured.ok else "n/a")
            + f" for '{result.dp_label}' ({result.cover.states} DP states)"
        )
        lines.append(f"border costs learned from the plans measured: {result.border.describe()}")
    if result.adjust_s:
        adj = ", ".join(f"{k} {v * 1e6:+.1f} us" for k, v in result.adjust_s.items())
        lines.append(f"per-region cost in a whole model vs isolated: {adj}")
    if plan.model_file is not None:
        lines.append(
            f"NO PARTITIONED PLAN BEAT {plan.notes['chosen_as']}: the plan is "
            f"{plan.model_file.describe()}, unpartitioned; the "
            f"best partitioned plan, '{plan.notes.get('best_partitioned')}', ran "
            + (
                f"{plan.notes['best_partitioned_median_s'] * 1e3:.3f} ms"
                if plan.notes.get("best_partitioned_median_s")
                else "n/a"
            )
            + " (interleaved medians)"
        )
    lines += _share_table(plan)
    lines += _plan_table(result)
    lines.extend(_verdict_lines(result))
    lines.append("")
    if (error := plan.notes.get("rel_error")) is not None:
        reduced = "/".join(p for p in plan.precisions if p != "f32") or "f32"
        lines.append(
            f"{reduced} within the accuracy budget: the plan's error against f32 is "
            f"{error:.1e} (at most {plan.notes['tolerance']:g}), on samples the search did not "
            "calibrate on"
        )
    lines.append(f"candidates measured on {result.inputs_from} inputs")
    if result.counts.skipped:
        lines.append(f"cost model: {result.counts.skipped} candidates ranked out of measuring")
    if result.tuning.seconds:
        from partune.backends import registry

        in_plan = sum(registry.get(r.backend).autotuned for r in plan.regions)
        lines.append(
            f"auto-tuning: {result.tuning.regions} regions tuned ({result.tuning.trials} "
            f"MetaSchedule trials) in {result.tuning.seconds:.0f} s; {in_plan} tuned region(s) in "
            "the emitted plan"
        )
        if result.tuning.achieved:
            lines.append(
                "  speed-up of tuning over default schedules, measured: "
                + ", ".join(
                    f"{kind} {min(s):.1f}-{max(s):.1f}x ({len(s)})"
                    for kind, s in sorted(result.tuning.achieved.items())
                )
            )
    if result.refined is not None:
        lines.append(
            f"refinement: {result.refined.trials} plan variants in its study"
            + (
                f", converged (no faster variant in the last {PATIENCE} trials)"
                if result.refined.converged
                else ""
            )
        )
    lines.append(
        f"search {result.search_s:.1f} s; candidates {result.counts.candidates}; measurements made "
        f"{result.counts.measured} ({result.counts.failed} failed), reused {result.counts.reused}"
        + ("; stopped early at --timeout" if result.timed_out else "")
    )
    if result.memory.search:
        lines.append(memory_line(result.memory))
    return "\n".join(lines)


def _share_table(plan) -> list[str]:
    """Per backend (and precision) of the plan: its regions, ops and share of the time."""
    known = plan.estimated_cost_s()
    lines = []
    lines.append(f"| {'backend':<14} | {'regions':>7} | {'ops':>5} | {'share of time':>13} |")
    lines.append("|----------------|---------|-------|---------------|")
    for b, precision in dict.fromkeys((r.backend, r.scope.precision) for r in plan.regions):
        regs = [r for r in plan.regions if r.backend == b and r.scope.precision == precision]
        share = f"{sum(r.cost_s or 0.0 for r in regs) / known:>12.1%}" if known else f"{'-':>13}"
        name = b + (f" {precision}" if precision else "")
        lines.append(
            f"| {name:<14} | {len(regs):>7} | {sum(len(r.nodes) for r in regs):>5} | {share} |"
        )
    return lines


def _plan_table(result) -> list[str]:
    """Every plan measured end to end, fastest first, against the fastest."""
    lines = []
    best = min(m.cost_s for m in result.end_to_end.values() if m.ok)
    lines.append("")
    lines.append(f"| {'plan':<36} | {'best ms':>9} | {'median ms':>9} | {'x fastest':>9} |")
    lines.append("|" + "-" * 38 + "|-----------|-----------|-----------|")
    for label, m in sorted(result.end_to_end.items(), key=lambda kv: kv[1].cost_s):
        if m.ok:
            lines.append(
                (
                    f"| {label:<36} | {m.cost_s * 1e3:9.3f} | {m.median_s * 1e3:9.3f} | "
                    f"{m.cost_s / best:9.2f} |"
                )
                + (f"  error {m.rel_error:.1e} vs f32" if m.rel_error is not None else "")
            )
        else:
            status = "skipped" if (m.error or "").startswith(NOT_MEASURED) else "failed"
            lines.append(
                f"| {label:<36} | {status:>9} | {'-':>9} | {'-':>9} |  {clean_error(m.error or '')}"
            )
    return lines


def memory_line(peaks) -> str:
    """``partune.search.result.MemoryPeaks`` in one line: the peak resident size of each process."""

    def part(name: str, size: int, recycled: int) -> str:
        return f"{name} {size / 1e9:.1f} GB" + (
            f" (recycled {recycled} time{'s' * (recycled != 1)})" if recycled else ""
        )

    parts = [part("search", peaks.search, 0)]
    if peaks.measuring:
        parts.append(part("measuring workers", peaks.measuring, peaks.measuring_recycled))
    if peaks.build_pool:
        parts.append(part("build pool", peaks.build_pool, peaks.build_pool_recycled))
    return "peak memory: " + ", ".join(parts)


def _verdict_lines(result) -> list[str]:
    """The finalists against the peers (interleaved rounds), said plainly."""
    if not result.verdict.measurements:
        return []
    ok = {k: m for k, m in result.verdict.measurements.items() if m.ok}
    peer = result.verdict.best_peer
    lines = [
        "",
        f"finalists vs the tools you would use instead ({result.verdict.how}, interleaved rounds):",
        f"| {'contender':<36} | {'median ms':>9} | {'best ms':>9} | "
        + (f"{'vs ' + peer:<40} |" if peer else "x fastest |"),
        "|" + "-" * 38 + "|-----------|-----------|" + ("-" * 42 + "|" if peer else "-----------|"),
    ]
    ref = (
        result.verdict.measurements[peer].median_s
        if peer
        else min((m.median_s for m in ok.values()), default=1.0)
    )
    for label, m in sorted(
        result.verdict.measurements.items(),
        key=lambda kv: kv[1].median_s if kv[1].ok else float("inf"),
    ):
        kind = "(peer) " if label in result.verdict.peers else ""
        if m.ok:
            ratio = ref / m.median_s if peer else m.median_s / ref
            lines.append(
                f"| {kind + label:<36} | {m.median_s * 1e3:9.3f} | {m.cost_s * 1e3:9.3f} | "
                + (f"{ratio:>39.2f}x |" if peer else f"{ratio:9.2f} |")
                + (f"  error {m.rel_error:.1e} vs f32" if m.rel_error is not None else "")
                + (
                    ", OVER THE BUDGET: not a bar to beat"
                    if result.verdict.over_budget(label)
                    else ""
                )
            )
        else:
            lines.append(
                f"| {kind + label:<36} | {'unavailable' if kind else 'failed':>9} | {'-':>9} | "
                f"{clean_error(m.error or '')}"
            )
    if result.verdict.left_out:
        lines.append(result.verdict.left_out)
    notes = result.plan.notes
    if "speedup_vs_best_peer" in notes:
        x = notes["speedup_vs_best_peer"]
        if result.plan.model_file is not None:
            lines.append(
                f"the plan is {notes['chosen_as']} itself"
                + (
                    f", {x:.2f}x as fast as {peer}"
                    if peer != notes["chosen_as"]
                    else ", the best peer"
                )
            )
        elif x >= 1.0 + NOISE:
            lines.append(f"the plan is {x:.2f}x as fast as {peer}, the best peer (medians)")
        elif x >= 1.0 - NOISE:
            lines.append(
                f"the plan ties {peer}, the best peer ({x:.2f}x: within {NOISE:.0%}, "
                "the noise of such measurements)"
            )
        else:
            lines.append(
                f"NO PLAN BEATS {peer}: the best plan runs at {x:.2f}x its speed; "
                f"{peer} alone serves this model better on this machine"
            )
        if x < 1.0 + NOISE or result.plan.model_file is not None:
            lines.append(
                "whether a longer search could do better: `partune headroom MODEL` measures the "
                "most any f32 plan could gain over the libraries here"
            )
    return lines
