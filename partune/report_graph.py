"""The model graph with its plan regions as coloured clusters, op names on every box.

A plan is a set of node indices per backend; what a person wants to see is which part of
the model went where. Graphviz lays the graph out best, so it draws it where its ``dot``
program is installed (Debian's ``graphviz``); elsewhere a layered matplotlib layout does.
A graph of hundreds of nodes would be unreadable drawn node by node, so chains of one
region collapse into one box that names its ops, and past ``MAX_BOXES`` each region is
one box.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from partune.core import DataflowGraph, Plan, region_order, short_op

COLOURS = {
    "tvm": "#4c72b0",
    "tvm-tuned": "#64b5cd",
    "torch": "#dd8452",
    "onnxruntime": "#55a868",
    "openvino": "#c44e52",
}
OTHER_COLOUR = "#8172b3"
DETAILED_UP_TO = 120  # nodes: drawn one box each up to this
MAX_BOXES = 150  # chains collapsed and still more boxes than this: one box per region
MAX_LINES = 3  # op lines in a collapsed box


def colour(backend: str) -> str:
    return COLOURS.get(backend, OTHER_COLOUR)


def _light(hex_colour: str, keep: float = 0.22) -> str:
    """The colour mixed with white (``keep`` of it left): a cluster's background."""
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * keep):02x}" for c in rgb)


def op_summary(
    graph: DataflowGraph, nodes: tuple[int, ...] | list[int], width: int = MAX_LINES
) -> list[str]:
    """A set of nodes in words: the op chain when short (``conv2d+add+relu``), else the
    most frequent ops with counts (``matmul x4``, ``add x6``, ``+3 more``)."""
    ops = [short_op(graph.nodes[n].op) for n in sorted(nodes)]
    if len(ops) <= 3:
        return ["+".join(ops)]
    counts = Counter(ops).most_common()
    lines = [f"{op} x{k}" if k > 1 else op for op, k in counts[:width]]
    if len(counts) > width:
        lines.append(f"+{len(counts) - width} more op kinds")
    return lines


@dataclass(frozen=True)
class Box:
    """One box of the picture: some nodes of one region, drawn as one."""

    id: str
    nodes: tuple[int, ...]
    region: int
    backend: str
    lines: tuple[str, ...]  # what the box says
    inputs: tuple[str, ...]  # ids of the boxes feeding it
    output: bool  # holds a node whose value the model returns


def _groups_by_chain(graph: DataflowGraph, region_of: dict[int, int]) -> list[list[int]]:
    """Maximal chains of one region: a node joins its producer's group when it is that
    producer's only consumer and reads no other node."""
    group_of: dict[int, int] = {}
    groups: list[list[int]] = []
    for node in graph.nodes:
        p = node.inputs[0] if len(node.inputs) == 1 else None
        if (
            p is not None
            and region_of[p] == region_of[node.index]
            and graph.consumers[p] == (node.index,)
            and groups[group_of[p]][-1] == p
        ):
            group_of[node.index] = group_of[p]
            groups[group_of[p]].append(node.index)
        else:
            group_of[node.index] = len(groups)
            groups.append([node.index])
    return groups


def boxes(graph: DataflowGraph, plan: Plan) -> list[Box]:
    """The boxes to draw, in topological order: one per node for a small graph, else
    chains collapsed, else one per region."""
    region_of = {n: k for k, r in enumerate(plan.regions) for n in r.nodes}
    if len(graph) <= DETAILED_UP_TO:
        groups = [[n] for n in range(len(graph))]
    else:
        groups = _groups_by_chain(graph, region_of)
        if len(groups) > MAX_BOXES:
            groups = [sorted(plan.regions[k].nodes) for k in region_order(graph, plan.regions)]
    box_of = {n: i for i, g in enumerate(groups) for n in g}
    outputs = set(graph.outputs)
    out = []
    for i, g in enumerate(groups):
        region = region_of[g[0]]
        feeds = dict.fromkeys(
            f"b{box_of[p]}" for n in g for p in graph.nodes[n].inputs if box_of[p] != i
        )
        if len(g) == 1:
            node = graph.nodes[g[0]]
            shape = node.shapes[0] if len(node.shapes) == 1 and node.shapes[0] is not None else None
            lines = [short_op(node.op)] + (
                [f"{'x'.join(map(str, shape)) or 'scalar'}"] if shape is not None else []
            )
        else:
            lines = op_summary(graph, g) + [f"({len(g)} nodes)"]
        out.append(
            Box(
                f"b{i}",
                tuple(g),
                region,
                plan.regions[region].backend,
                tuple(lines),
                tuple(feeds),
                any(n in outputs for n in g),
            )
        )
    return out


def time_text(seconds: float) -> str:
    """Seconds as a person reads them, with as many digits as a microsecond region needs."""
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us" if seconds < 1e-5 else f"{seconds * 1e6:.0f} us"


def region_caption(plan: Plan, k: int) -> str:
    """``r03 openvino, 12 us in model``: the region, its backend and the plan's cost of it
    inside the whole model (isolated times, in the region plot, include the call)."""
    r = plan.regions[k]
    return f"r{k:02d} {r.backend}" + (
        f", {time_text(r.cost_s)} in model" if r.cost_s is not None else ""
    )


def has_dot() -> bool:
    """Whether Graphviz's ``dot`` program is installed (the Python package only drives it)."""
    return shutil.which("dot") is not None


def draw_graph(graph: DataflowGraph, plan: Plan, out: Path) -> list[Path]:
    """``out``/graph.png (and with graphviz graph.svg, zoomable, and graph.dot); returns the
    files."""
    drawn = boxes(graph, plan)
    if has_dot():
        return _draw_graphviz(drawn, plan, out)
    return [_draw_matplotlib(drawn, plan, region_order(graph, plan.regions), out / "graph.png")]


def _draw_graphviz(drawn: list[Box], plan: Plan, out: Path) -> list[Path]:
    import graphviz

    dot = graphviz.Digraph(
        plan.model,
        graph_attr={
            "rankdir": "TB",
            "fontname": "Helvetica",
            "nodesep": "0.2",
            "ranksep": "0.3",
            "label": _title(drawn, plan),
            "labelloc": "t",
        },
        node_attr={
            "shape": "box",
            "style": "rounded,filled",
            "fontname": "Helvetica",
            "fontsize": "10",
            "fontcolor": "white",
            "margin": "0.08,0.03",
        },
        edge_attr={"color": "#777777", "arrowsize": "0.6"},
    )
    for k in sorted({b.region for b in drawn}):
        with dot.subgraph(name=f"cluster_{k}") as c:
            c.attr(
                label=region_caption(plan, k),
                style="rounded,filled",
                color=colour(plan.regions[k].backend),
                fillcolor=_light(colour(plan.regions[k].backend)),
                fontsize="10",
                fontname="Helvetica",
            )
            for b in (b for b in drawn if b.region == k):
                c.node(
                    b.id,
                    "\n".join(b.lines),
                    fillcolor=colour(b.backend),
                    peripheries="2" if b.output else "1",
                )
    for b in drawn:
        for src in b.inputs:
            dot.edge(src, b.id)
    (out / "graph.dot").write_text(dot.source)
    (out / "graph.png").write_bytes(dot.pipe(format="png"))
    (out / "graph.svg").write_bytes(dot.pipe(format="svg"))
    return [out / "graph.png", out / "graph.svg", out / "graph.dot"]


def _title(drawn: list[Box], plan: Plan) -> str:
    nodes = sum(len(b.nodes) for b in drawn)
    how = (
        "one box per node"
        if len(drawn) == nodes
        else f"{len(drawn)} boxes (chains of one region collapsed)"
    )
    return f"{plan.model}: {nodes} nodes, {len(plan.regions)} regions; {how}"


def layers(
    drawn: list[Box], order: list[int], per_column: int = 40
) -> dict[str, tuple[int, int, float]]:
    """A layered layout, region by region: per box (column, row, place in the row).

    Each region (in ``order``, topological) takes a band of rows of its own, its boxes
    layered by their longest path inside it, so clusters never overlap and every edge
    points down or to a later column; a band that does not fit what is left of a column
    starts the next one. In a row, boxes sit in the mean place of what feeds them.
    """
    local: dict[str, int] = {}
    region_of = {b.id: b.region for b in drawn}
    for b in drawn:  # topological order
        local[b.id] = 1 + max((local[s] for s in b.inputs if region_of[s] == b.region), default=-1)
    start: dict[int, tuple[int, int]] = {}
    column, row = 0, 0
    for k in order:
        depth = 1 + max((local[b.id] for b in drawn if b.region == k), default=-1)
        if depth == 0:
            continue
        if row and row + depth > per_column:
            column, row = column + 1, 0
        start[k] = (column, row)
        row += depth
    place: dict[str, tuple[int, int, float]] = {}
    by_row: dict[tuple[int, int], list[Box]] = {}
    for b in drawn:
        c, r = start[b.region]
        by_row.setdefault((c, r + local[b.id]), []).append(b)
    for (c, r), boxes_ in sorted(by_row.items()):
        mean = {
            b.id: sum(place[s][2] for s in b.inputs if s in place) / max(len(b.inputs), 1)
            if b.inputs
            else i
            for i, b in enumerate(boxes_)
        }
        boxes_.sort(key=lambda b: mean[b.id])
        for i, b in enumerate(boxes_):
            place[b.id] = (c, r, i - (len(boxes_) - 1) / 2)
    return place


def _draw_matplotlib(drawn: list[Box], plan: Plan, order: list[int], path: Path) -> Path:
    """The region-banded layout (``layers``) drawn with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    place = layers(drawn, order)
    width = max(abs(x) for _, _, x in place.values()) * 2 + 1
    columns = 1 + max(c for c, _, _ in place.values())
    rows = 1 + max(r for _, r, _ in place.values())
    col_w = 2.4 * width + 1.2

    def xy(box_id: str) -> tuple[float, float]:
        c, r, x = place[box_id]
        return c * col_w + 2.4 * x, -float(r)

    fig, ax = plt.subplots(figsize=(min(2 + 2.2 * width * columns, 60), min(1.5 + 0.62 * rows, 60)))
    _clusters(ax, drawn, plan, place, xy)
    for b in drawn:
        x1, y1 = xy(b.id)
        for s in b.inputs:
            x0, y0 = xy(s)
            ax.plot([x0, x1], [y0 - 0.3, y1 + 0.3], color="#888888", lw=0.6, zorder=1)
    for b in drawn:
        x, y = xy(b.id)
        ax.text(
            x,
            y,
            "\n".join(b.lines[:2]),
            ha="center",
            va="center",
            fontsize=6,
            color="white",
            zorder=4,
            bbox={
                "boxstyle": "round,pad=0.25",
                "fc": colour(b.backend),
                "ec": "black" if b.output else colour(b.backend),
                "lw": 1.2 if b.output else 0.5,
            },
        )
    ax.set_xlim(-1.3 - 1.2 * width, (columns - 1) * col_w + 1.3 + 1.2 * width)
    ax.set_ylim(-rows + 0.4, 0.9)
    ax.axis("off")
    used = sorted({b.backend for b in drawn})
    ax.legend(
        handles=[Patch(color=colour(u), label=u) for u in used],
        loc="lower center",
        ncol=len(used),
        frameon=False,
        bbox_to_anchor=(0.5, 1.0),
        fontsize=7,
    )
    ax.set_title(_title(drawn, plan), fontsize=9, pad=22)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _clusters(ax, drawn: list[Box], plan: Plan, place: dict, xy) -> None:
    """Each region's band: a rounded rectangle in its backend's light colour, captioned."""
    from matplotlib.patches import FancyBboxPatch

    for k in sorted({b.region for b in drawn}):
        mine = [b for b in drawn if b.region == k]
        pts = [xy(b.id) for b in mine]
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        back = colour(plan.regions[k].backend)
        ax.add_patch(
            FancyBboxPatch(
                (min(xs) - 1.15, min(ys) - 0.4),
                max(xs) - min(xs) + 2.3,
                max(ys) - min(ys) + 0.9,
                boxstyle="round,pad=0.02",
                fc=_light(back),
                ec=back,
                lw=0.8,
                zorder=0,
            )
        )
        ax.text(
            min(xs) - 1.1, max(ys) + 0.3, region_caption(plan, k), fontsize=6, color=back, zorder=3
        )
