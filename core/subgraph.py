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
        return self.mask.bit_count()

    def __contains__(self, node: int) -> bool:
        return bool(self.mask >> node & 1)

    @cached_property
    def inputs(self) -> tuple[int, ...]:
        """Producer nodes outside the sub-graph that feed it."""
        masks = self.graph.input_masks
        feed = 0
        for n in self.nodes:
            feed |= masks[n]
        return tuple(bits(feed & ~self.mask))

    @cached_property
    def entries(self) -> tuple[int, ...]:
        """Nodes reading something from outside (or nothing at all)."""
        masks, outside = self.graph.input_masks, ~self.mask
        return tuple(n for n in self.nodes if not masks[n] or masks[n] & outside)

    @cached_property
    def exits(self) -> tuple[int, ...]:
        """Nodes whose value is read outside, or returned by main."""
        g = self.graph
        masks, outside, outs = g.consumer_masks, ~self.mask, g.output_mask
        return tuple(n for n in self.nodes if outs >> n & 1 or masks[n] & outside)

    @cached_property
    def consumers_mask(self) -> int:
        """Every node that reads a value of the sub-graph (inside it or not), as a bitmask."""
        masks = self.graph.consumer_masks
        out = 0
        for n in self.nodes:
            out |= masks[n]
        return out

    @cached_property
    def depth(self) -> int:
        """Nodes on the longest path inside the sub-graph."""
        nodes, mask = self.graph.nodes, self.mask
        longest: dict[int, int] = {}
        deepest = 0
        for n in self.nodes:  # topological order
            d = 0
            for p in nodes[n].inputs:
                if mask >> p & 1 and longest[p] > d:
                    d = longest[p]
            longest[n] = d + 1
            deepest = max(deepest, d + 1)
        return deepest

    @cached_property
    def kind(self) -> OpKind:
        """The sub-graph's op-pattern kind: the largest kind of its nodes (tuples ignored)."""
        kinds = [self.graph.nodes[n].kind for n in self.nodes]
        real = [k for k in kinds if k != OpKind.TUPLE]
        return max(real) if real else OpKind.TUPLE

    @cached_property
    def is_convex(self) -> bool:
        """No path from the sub-graph through an outside node back into it.

        An outside node on such a path is both below an exit and above an entry: the test is
        one intersection of two masks, O(size of the sub-graph), not a walk of the graph below it.
        """
        g = self.graph
        reach, up = g.reach, g.ancestors
        below = 0
        for n in self.exits:
            below |= reach[n]
        below &= ~self.mask
        if not below:
            return True
        above = 0
        for n in self.entries:
            above |= up[n]
        return not (below & above & ~self.mask)

    def is_valid(self, max_exits: int | None = None, max_depth: int | None = None) -> bool:
        # The cheap tests first; all three must hold, so the order changes no answer.
        return (
            (max_exits is None or len(self.exits) <= max_exits)
            and self.is_convex
            and (max_depth is None or self.depth <= max_depth)
        )

    def touches(self, other: SubGraph) -> bool:
        """Whether an edge runs from this sub-graph into ``other``."""
        return bool(self.consumers_mask & other.mask)

    def union(self, other: SubGraph) -> SubGraph:
        return SubGraph(self.mask | other.mask, self.graph)

    def __str__(self) -> str:
        return "{" + ",".join(map(str, self.nodes)) + "}"
