"""Candidates: (SubGraph, SEScope, rule) for every scope the CompilationConfig offers.

The search reaches backends only through ``partune.backends.registry``: a backend says which
nodes it accepts, its fusion style picks the partition rule, its patterns feed the
pattern rule. Pinned nodes keep their SEScope: a candidate whose scope is incompatible
with a pin on any of its nodes is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import WildcardPattern

from partune.backends import registry
from partune.core import (
    CompilationConfig,
    DataflowGraph,
    Plan,
    SEScope,
    SubGraph,
    casts,
    main_bindings,
    quantizes,
    single_backend_plan,
)
from partune.search.rules import RuleContext, rule_for_style


@dataclass(frozen=True)
class Candidate:
    subgraph: SubGraph
    scope: SEScope
    rule: str

    def __hash__(self) -> int:
        # The dataclass's hash, computed once: the search keys several dicts by candidate, and
        # an SEScope's hash serialises its target each time (thousands of candidates, many rounds).
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash((self.subgraph, self.scope, self.rule))
            object.__setattr__(self, "_hash", h)
            return h

    def __getstate__(self) -> dict:
        return {
            k: v for k, v in self.__dict__.items() if k != "_hash"
        }  # str hashes vary by process

    @property
    def backend(self) -> str:
        assert self.scope.backend is not None
        return self.scope.backend

    def __str__(self) -> str:
        return f"{self.scope.backend}{self.subgraph} ({self.rule})"


def _matcher(func: relax.Function):
    """Pattern -> node sets of its matches in main (rooted at each binding)."""
    bindings = main_bindings(func)
    index = {b.value: i for i, b in enumerate(bindings)}
    var2val = relax.analysis.get_var2val(func)

    def match(pattern) -> list[frozenset[int]]:
        out = []
        for b in bindings:
            if not isinstance(b.value, relax.Call):
                continue
            found = pattern.extract_matched_expr(b.value, var2val)
            if found:
                nodes = frozenset(
                    index[e]
                    for p, e in found.items()
                    if e in index and not isinstance(p, WildcardPattern)
                )
                if nodes:
                    out.append(nodes)
        return out

    return match


def accepted_nodes(func: relax.Function, backend: str) -> set[int]:
    impl = registry.get(backend)
    return {i for i, b in enumerate(main_bindings(func)) if impl.accepts(b)}


# What each reduced precision computes faster: a region in it must hold one such node. Under
# TVM it would otherwise compute exactly as in f32; elsewhere it gains little but pays its
# borders (``partune.core.bf16.casts``, ``partune.core.int8.quantizes``).
_FASTER = {"bf16": casts, "int8": quantizes}


def precision_nodes(func: relax.Function, config: CompilationConfig) -> dict[str, frozenset[int]]:
    """Per reduced precision ``config`` offers, the nodes it computes faster."""
    bindings = main_bindings(func)
    return {
        p: frozenset(i for i, b in enumerate(bindings) if faster(b.value))
        for p, faster in _FASTER.items()
        if p in config.precisions
    }


def backend_plan(
    name: str,
    mod: tvm.IRModule,
    graph: DataflowGraph,
    config: CompilationConfig,
    backend: str,
    precision: str = "f32",
    threads: int | None = None,
) -> Plan:
    """The single-backend plan: all that ``backend`` accepts goes to it, the rest to the default."""
    return single_backend_plan(
        name, graph, config, backend, accepted_nodes(mod["main"], backend), precision, threads
    )


def enumerate_candidates(
    mod: tvm.IRModule,
    graph: DataflowGraph,
    config: CompilationConfig,
    pins: dict[int, SEScope] | None = None,
) -> list[Candidate]:
    """All candidates of all primitive scopes, deduplicated, pins respected."""
    func = mod["main"]
    pins = pins or {}
    match = _matcher(func)
    out: dict[tuple[int, int], Candidate] = {}  # (node set, scope number) -> its first candidate
    number: dict[SEScope, int] = {}  # equal scopes share a number (a scope's hash is not cheap)
    proposed: dict[str, list] = {}  # a backend's proposals, shared by its scopes (f32, bf16, int8)
    masks = {p: sum(1 << i for i in nodes) for p, nodes in precision_nodes(func, config).items()}
    for scope in config.primitives:
        if scope.threads:
            # A one-thread twin competes whole (single-library plans) and in refinement, not per
            # candidate: it would double its library's candidates to measure, for a gain found
            # mostly on small models run whole.
            continue
        at = number.setdefault(scope, len(number))
        if scope.backend not in proposed:
            backend = registry.get(scope.backend)
            ok = accepted_nodes(func, scope.backend)
            rule = rule_for_style(backend.fusion_style.value, backend.patterns())
            proposed[scope.backend] = rule.propose(RuleContext(graph, ok.__contains__, match))
        faster = masks.get(scope.compute_precision)
        for prop in proposed[scope.backend]:
            if faster is not None and not prop.subgraph.mask & faster:
                continue  # nothing in it that its precision computes faster
            if all(scope.compatible(pins[n]) for n in prop.subgraph.nodes if n in pins):
                out.setdefault((prop.subgraph.mask, at), Candidate(prop.subgraph, scope, prop.rule))
    return sorted(out.values(), key=lambda c: (c.subgraph.nodes[0], len(c.subgraph), c.backend))
