"""SubGraph: a set of nodes of a DataflowGraph, and whether it can run as one unit.

A sub-graph is valid when it is convex (no path leaves it and comes back, or no program
could run it as one call), has at most ``max_exits`` exits and at most ``max_depth``
nodes on its longest internal path. Node sets are bitmasks: unions and overlap tests on
graphs of thousands of nodes stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from partune.core.graph import DataflowGraph, OpKind


def bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass(frozen=True)
class SubGraph:
    """A node set of ``graph`` (compared and hashed by its nodes only)."""

    mask: int
    graph: DataflowGraph

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SubGraph) and self.mask == other.mask

    def __hash__(self) -> int:
        return hash(self.mask)

    @classmethod
    def of(cls, graph: DataflowGraph, nodes) -> SubGraph:
        mask = 0
        for n in nodes:
            mask |= 1 << n
        return cls(mask, graph)

    @cached_property
    def nodes(self) -> tuple[int, ...]:
        return tuple(bits(self.mask))

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, node: int) -> bool:
        return bool(self.mask >> node & 1)

    @cached_property
    def inputs(self) -> tuple[int, ...]:
        """Producer nodes outside the sub-graph that feed it."""
        g = self.graph
        return tuple(sorted({p for n in self.nodes for p in g.nodes[n].inputs if p not in self}))

    @cached_property
    def entries(self) -> tuple[int, ...]:
        """Nodes reading something from outside (or nothing at all)."""
        g = self.graph
        return tuple(n for n in self.nodes
                     if not g.nodes[n].inputs or any(p not in self for p in g.nodes[n].inputs))

    @cached_property
    def exits(self) -> tuple[int, ...]:
        """Nodes whose value is read outside, or returned by main."""
        g = self.graph
        outs = set(g.outputs)
        return tuple(n for n in self.nodes
                     if n in outs or any(c not in self for c in g.consumers[n]))

    @cached_property
    def depth(self) -> int:
        """Nodes on the longest path inside the sub-graph."""
        g = self.graph
        longest: dict[int, int] = {}
        for n in self.nodes:  # topological order
            longest[n] = 1 + max((longest[p] for p in g.nodes[n].inputs if p in self), default=0)
        return max(longest.values(), default=0)

    @cached_property
    def kind(self) -> OpKind:
        """The sub-graph's op-pattern kind: the largest kind of its nodes (tuples ignored)."""
        kinds = [self.graph.nodes[n].kind for n in self.nodes]
        real = [k for k in kinds if k != OpKind.TUPLE]
        return max(real) if real else OpKind.TUPLE

    @cached_property
    def is_convex(self) -> bool:
        """No path from the sub-graph through an outside node back into it."""
        reach = self.graph.reach
        below = 0
        for n in self.exits:
            below |= reach[n]
        below &= ~self.mask
        return all(not (reach[o] & self.mask) for o in bits(below))

    def is_valid(self, max_exits: int | None = None, max_depth: int | None = None) -> bool:
        return (self.is_convex and (max_exits is None or len(self.exits) <= max_exits)
                and (max_depth is None or self.depth <= max_depth))

    def touches(self, other: SubGraph) -> bool:
        """Whether an edge runs from this sub-graph into ``other``."""
        g = self.graph
        return any(c in other for n in self.nodes for c in g.consumers[n])

    def union(self, other: SubGraph) -> SubGraph:
        return SubGraph(self.mask | other.mask, self.graph)

    def __str__(self) -> str:
        return "{" + ",".join(map(str, self.nodes)) + "}"
