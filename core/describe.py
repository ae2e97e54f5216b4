"""How regions and tables read to people: op summaries instead of node indices, fitted columns.

Node-index lists mean nothing to a reader; ``matmul x2, add, gelu`` does. Progress bars,
``partune status`` and ``partune explain`` all show regions and tables, so they share
these few functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the graph module imports TVM; a status table need not)
    from partune.core.graph import DataflowGraph
    from partune.core.scopes import SEScope


def short_op(op: str) -> str:
    """An op as people name it: ``nn.conv2d`` -> ``conv2d``."""
    return op[len("nn.") :] if op.startswith("nn.") else op


def op_counts(graph: DataflowGraph, nodes: Iterable[int]) -> dict[str, int]:
    """How often each op occurs among ``nodes``, in the order ops first appear."""
    counts: dict[str, int] = {}
    for n in sorted(set(nodes)):
        op = short_op(graph.nodes[n].op)
        counts[op] = counts.get(op, 0) + 1
    return counts


def _counted(op: str, count: int) -> str:
    return f"{op} x{count}" if count > 1 else op


def op_summary(graph: DataflowGraph, nodes: Iterable[int], limit: int | None = None) -> str:
    """``matmul x2, add, gelu``: the ops of a region by name and count (at most ``limit`` kinds)."""
    parts = [_counted(op, c) for op, c in op_counts(graph, nodes).items()]
    if limit is not None and len(parts) > limit:
        parts = parts[:limit] + [f"+{len(parts) - limit} more kinds"]
    return ", ".join(parts)


def scope_name(scope: SEScope) -> str:
    """A scope as people name it: its backend, its precision when not f32, and its thread
    count when not the job's ("openvino bf16", "onnxruntime 1 thread")."""
    return (
        (scope.backend or str(scope))
        + (f" {scope.precision}" if scope.precision else "")
        + (f" {threads_label(scope.threads)}" if scope.threads else "")
    )


def threads_label(threads: int) -> str:
    return f"{threads} thread" + ("s" if threads > 1 else "")


def variant_label(precision: str, threads: int | None) -> str:
    """How a plan's name says what differs from f32 on the job's threads: "" or " (bf16, 1
    thread)"."""
    parts = ([precision] if precision != "f32" else []) + (
        [threads_label(threads)] if threads else []
    )
    return f" ({', '.join(parts)})" if parts else ""


def region_label(graph: DataflowGraph, nodes: Iterable[int], width: int = 40) -> str:
    """A short name for a region: ``conv2d+relu x3`` when one op chain repeats, else
    ``matmul x2+add+gelu``; cut to ``width`` characters."""
    ops = [short_op(graph.nodes[n].op) for n in sorted(set(nodes))]
    label = ""
    for size in range(1, len(ops) // 2 + 1):
        times, rest = divmod(len(ops), size)
        if not rest and ops[:size] * times == ops:
            label = _counted("+".join(ops[:size]), times)
            break
    if not label:
        counts = op_counts(graph, nodes)
        label = "+".join(_counted(op, c) for op, c in counts.items())
    return label if len(label) <= width else label[: max(width - 3, 1)] + "..."


def fit_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "", pipes: bool = False
) -> list[str]:
    """Lines of a table whose columns are as wide as their widest cell (nothing cut).

    ``align`` holds one character per column, ``<`` (the default) or ``>``; ``pipes``
    draws ``| a | b |`` with a rule under the header, else columns are two spaces apart.
    """
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    align = align.ljust(len(header), "<")

    def line(cells: Sequence[str]) -> str:
        padded = [f"{str(c):{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)]
        return ("| " + " | ".join(padded) + " |") if pipes else "  ".join(padded).rstrip()

    rule = (
        ("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        if pipes
        else "  ".join("-" * w for w in widths)
    )
    return [line(header), rule, *(line(r) for r in rows)]
