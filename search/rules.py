"""Partition rules: which sub-graphs a backend could run, Collage-style.

Base rules propose sub-graphs from the graph alone (op-by-kind, pattern, host);
combinators transform the proposals of other rules (composite, union, combine,
only-valid). Each backend's fusion style picks its rule (``rule_for_style``). A rule
sees a backend only through ``accepts``: the nodes it can translate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partune.core import DataflowGraph, OpKind, SubGraph

TRIVIAL_OPS = frozenset({"tuple", "get_item", "alias", "const"})


@dataclass(frozen=True)
class RuleContext:
    """What a rule may know besides the graph: which nodes the backend accepts, matches."""

    graph: DataflowGraph
    accepts: Callable[[int], bool]
    match: Callable[[object], list[frozenset[int]]] | None = None  # pattern -> node sets


@dataclass(frozen=True)
class Proposal:
    """A sub-graph a rule proposes, and the rule that proposed it (for people)."""

    subgraph: SubGraph
    rule: str


class PartitionRule(ABC):
    """Yields candidate sub-graphs for one backend."""

    name: str = "rule"

    @abstractmethod
    def propose(self, ctx: RuleContext) -> list[Proposal]: ...


def _dedup(props: list[Proposal]) -> list[Proposal]:
    seen: dict[int, Proposal] = {}
    for p in props:
        seen.setdefault(p.subgraph.mask, p)
    return list(seen.values())


# ---------------------------------------------------------------- base rules
@dataclass
class OpKindRule(PartitionRule):
    """One candidate per accepted non-trivial op whose kind is at most ``max_kind``."""

    max_kind: OpKind = OpKind.OPAQUE
    name: str = "op"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        return [
            Proposal(SubGraph.of(ctx.graph, [n.index]), self.name)
            for n in ctx.graph.nodes
            if n.op not in TRIVIAL_OPS and n.kind <= self.max_kind and ctx.accepts(n.index)
        ]


@dataclass
class HostRule(PartitionRule):
    """Trivial nodes (tuples, projections, aliases, constants): they cost nothing anywhere."""

    name: str = "host"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        return [
            Proposal(SubGraph.of(ctx.graph, [n.index]), self.name)
            for n in ctx.graph.nodes
            if n.op in TRIVIAL_OPS and ctx.accepts(n.index)
        ]


@dataclass
class PatternRule(PartitionRule):
    """One candidate per match of a dataflow pattern, when the backend accepts every node."""

    pattern: object
    name: str = "pattern"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        if ctx.match is None:
            return []
        return [
            Proposal(SubGraph.of(ctx.graph, nodes), self.name)
            for nodes in ctx.match(self.pattern)
            if all(ctx.accepts(n) for n in nodes)
        ]


def cut_points(graph: DataflowGraph, max_live: int = 1) -> list[int]:
    """Positions after which at most ``max_live`` values cross to later nodes.

    In post-DFS order these are the natural block boundaries (after a residual add or
    a layer norm): the places a graph-level compiler's region can start or end cheaply.
    Values far smaller than the model's typical one (``_negligible``: an attention mask
    every layer reads) are not counted: they cost nothing to pass across a border, and
    counting them left BERT-768 with 6 cut points at any depth, so its intervals grew with
    the model instead of recurring layer by layer (and sharing measurement keys).
    """
    n = len(graph)
    small = _negligible(graph)
    counted = [graph.nodes[i].out_bytes > small for i in range(n)]
    last = [max(graph.consumers[i], default=i) for i in range(n)]
    for i in graph.outputs:
        last[i] = n
    ends: dict[int, int] = {}
    for i, e in enumerate(last):
        if counted[i]:
            ends[e] = ends.get(e, 0) + 1
    cuts, live = [], 0
    for p in range(n - 1):
        live += counted[p] - ends.get(p, 0)
        if live <= max_live:
            cuts.append(p)
    return cuts


def _negligible(graph: DataflowGraph) -> float:
    """Values this small (1/64 of the median node's result) do not count as live at a cut."""
    sizes = sorted(node.out_bytes for node in graph.nodes)
    return sizes[len(sizes) // 2] / 64 if sizes else 0.0


@dataclass
class IntervalRule(PartitionRule):
    """Runs of whole blocks: intervals of post-DFS order between cut points.

    An interval of a topological order is always convex and its inputs all come before
    it, so these are the large regions (a whole layer, several layers, the whole model)
    that let a graph-level backend fuse across ops and pay its call overhead once.
    """

    max_segments: int = 8  # longest interval, in blocks, once the graph has many blocks
    all_below: int = 24  # up to this many blocks, every interval is proposed
    name: str = "interval"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        g = ctx.graph
        bounds = [-1, *cut_points(g), len(g) - 1]
        ok = [ctx.accepts(i) for i in range(len(g))]
        span = len(bounds) if len(bounds) - 1 <= self.all_below else self.max_segments
        out = []
        for a in range(len(bounds) - 1):
            for b in range(a + 1, min(len(bounds), a + 1 + span)):
                lo, hi = bounds[a] + 1, bounds[b]
                if hi - lo >= 1 and all(ok[lo : hi + 1]):
                    out.append(Proposal(SubGraph.of(g, range(lo, hi + 1)), self.name))
        # The maximal accepted runs: all of the model the backend can take, in one call. On a
        # model of many blocks, only runs of at most ``max_segments`` blocks: a longer one is
        # what the backend's single-backend plan runs, and that plan is measured end to end
        # anyway; timed as a region besides, it took 2.5 of the 12.5 minutes of a 24-layer
        # BERT's candidates, and its request (the model's weights as JSON) 9 GB of memory.
        start = None
        for i, accepted in enumerate([*ok, False]):
            if accepted and start is None:
                start = i
            elif not accepted and start is not None:
                blocks = 1 + sum(1 for b in bounds[1:-1] if start <= b < i - 1)
                if i - start >= 2 and (span == len(bounds) or blocks <= self.max_segments):
                    out.append(Proposal(SubGraph.of(g, range(start, i)), self.name))
                start = None
        return _dedup(out)


# ---------------------------------------------------------------- combinators
@dataclass
class CompositeRule(PartitionRule):
    """Proposals of ``rule`` labelled as composites (one fused library call)."""

    rule: PartitionRule
    name: str = "composite"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        return [Proposal(p.subgraph, f"{self.name}:{p.rule}") for p in self.rule.propose(ctx)]


@dataclass
class UnionRule(PartitionRule):
    rules: Sequence[PartitionRule]
    name: str = "union"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        return _dedup([p for r in self.rules for p in r.propose(ctx)])


@dataclass
class OnlyValidRule(PartitionRule):
    """Keeps proposals that are convex and within the exit and depth limits."""

    rule: PartitionRule
    max_exits: int | None = None
    max_depth: int | None = None
    name: str = "valid"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        return [
            p for p in self.rule.propose(ctx) if p.subgraph.is_valid(self.max_exits, self.max_depth)
        ]


# Combiner rules: may an upstream sub-graph and a downstream one it feeds be merged?
Combiner = Callable[[SubGraph, SubGraph], bool]


def by_kind(up: OpKind, down: OpKind) -> Combiner:
    """Merge when the upstream kind is at most ``up`` and the downstream at most ``down``."""
    return lambda u, d: u.kind <= up and d.kind <= down


def tuple_arg(u: SubGraph, d: SubGraph) -> bool:
    """A tuple joins the sub-graphs that build its fields."""
    return all(u.graph.nodes[n].op == "tuple" for n in d.nodes) and u.kind <= OpKind.INJECTIVE


def tuple_proj(u: SubGraph, d: SubGraph) -> bool:
    """A projection joins the sub-graph producing its tuple."""
    return all(u.graph.nodes[n].op in ("get_item", "alias") for n in d.nodes)


def anything(u: SubGraph, d: SubGraph) -> bool:
    return True


TVM_COMBINERS: dict[str, Combiner] = {
    "A->B": by_kind(OpKind.OUT_ELEMWISE_FUSABLE, OpKind.BROADCAST),
    "B->R": by_kind(OpKind.BROADCAST, OpKind.REDUCTION),
    "I->I": by_kind(OpKind.INJECTIVE, OpKind.INJECTIVE),
    "tuple-arg": tuple_arg,
    "tuple-proj": tuple_proj,
}
ARBITRARY_COMBINERS: dict[str, Combiner] = {"any": anything}


@dataclass
class CombineRule(PartitionRule):
    """Grows touching proposals by combiner rules to a fixed point (Collage's combine).

    Every merge must stay valid; ``max_candidates`` bounds the work on large graphs (the
    smallest merges come first, so the bound drops the largest regions).
    """

    rule: PartitionRule
    combiners: dict[str, Combiner]
    max_exits: int | None = 1
    max_depth: int | None = 8
    max_nodes: int | None = None
    max_candidates: int = 5000
    name: str = "combine"

    def propose(self, ctx: RuleContext) -> list[Proposal]:
        props = _dedup(self.rule.propose(ctx))
        known = {p.subgraph.mask for p in props}
        by_node: dict[int, list[Proposal]] = {}
        for p in props:
            for n in p.subgraph.nodes:
                by_node.setdefault(n, []).append(p)
        frontier = list(props)
        while frontier and len(props) < self.max_candidates:
            grown: list[Proposal] = []
            for up in frontier:
                for down in self._touching(ctx.graph, up, by_node):
                    for a, b in ((up, down), (down, up)):
                        if not a.subgraph.touches(b.subgraph):
                            continue
                        merged = self._merge(a, b, known)
                        if merged is not None:
                            grown.append(merged)
                            known.add(merged.subgraph.mask)
            grown.sort(key=lambda p: len(p.subgraph))
            grown = grown[: max(0, self.max_candidates - len(props))]
            for p in grown:
                for n in p.subgraph.nodes:
                    by_node.setdefault(n, []).append(p)
            props.extend(grown)
            frontier = grown
        return props

    @staticmethod
    def _touching(graph: DataflowGraph, p: Proposal, by_node: dict[int, list[Proposal]]):
        seen: set[int] = set()
        for n in p.subgraph.nodes:
            for m in (*graph.consumers[n], *graph.nodes[n].inputs):
                if m in p.subgraph:
                    continue
                for q in by_node.get(m, ()):
                    if q.subgraph.mask not in seen and not q.subgraph.mask & p.subgraph.mask:
                        seen.add(q.subgraph.mask)
                        yield q

    def _merge(self, up: Proposal, down: Proposal, known: set[int]) -> Proposal | None:
        sg = up.subgraph.union(down.subgraph)
        if sg.mask in known or (self.max_nodes and len(sg) > self.max_nodes):
            return None
        rule = next(
            (name for name, fits in self.combiners.items() if fits(up.subgraph, down.subgraph)),
            None,
        )
        if rule is None or not sg.is_valid(self.max_exits, self.max_depth):
            return None
        return Proposal(sg, f"{self.name}[{rule}]")


def rule_for_style(style: str, patterns: Sequence[tuple[str, object]] = ()) -> PartitionRule:
    """The partition rule a fusion style implies (Collage's per-backend rules).

    - ``none``: the backend's composite patterns plus single ops (op-level libraries),
      plus whole-block intervals, run op after op in one call (saves call overhead);
    - ``tvm``: single ops grown by TVM's fusion rules (A->B, B->R, I->I, tuples);
    - ``arbitrary``: single ops grown by any touching merge, plus whole-block intervals
      (graph-level compilers).
    """
    singles = UnionRule([OpKindRule(), HostRule()])
    if style == "none":
        composites = [CompositeRule(PatternRule(p, name=n)) for n, p in patterns]
        return UnionRule(
            [OnlyValidRule(UnionRule([*composites, singles]), max_exits=1), IntervalRule()]
        )
    if style == "tvm":
        return CombineRule(singles, TVM_COMBINERS, max_exits=1, max_depth=8)
    if style == "arbitrary":
        grown = CombineRule(singles, ARBITRARY_COMBINERS, max_exits=1, max_depth=6, max_nodes=16)
        return UnionRule([grown, IntervalRule()])
    raise ValueError(f"unknown fusion style '{style}'")
