"""The search at scale gives exactly what the plain algorithms give.

Sub-graph tests as mask operations, region keys from per-node JSON text (memoised), and a
DP that keeps one candidate per node set: each is compared here with the straightforward
version it replaced, on random graphs and on a stack of identical layers.
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from tvm import relax

from partune.core.graph import DataflowGraph, Node, OpKind
from partune.core.keys import KEY_DIGITS, candidate_key, region_key
from partune.core.scopes import CompilationConfig
from partune.core.subgraph import SubGraph, bits
from partune.search.candidates import Candidate
from partune.search.dp import cheapest_cover, schedulable
from partune.search.rules import RuleContext, rule_for_style
from tests.graphs import Attention, Diamond, Residual, TupleGraph

# ----------------------------------------------------------------- the plain versions


def plain_inputs(s: SubGraph) -> tuple[int, ...]:
    g = s.graph
    return tuple(sorted({p for n in s.nodes for p in g.nodes[n].inputs if p not in s}))


def plain_entries(s: SubGraph) -> tuple[int, ...]:
    g = s.graph
    return tuple(
        n for n in s.nodes if not g.nodes[n].inputs or any(p not in s for p in g.nodes[n].inputs)
    )


def plain_exits(s: SubGraph) -> tuple[int, ...]:
    g = s.graph
    return tuple(
        n for n in s.nodes if n in set(g.outputs) or any(c not in s for c in g.consumers[n])
    )


def plain_depth(s: SubGraph) -> int:
    g = s.graph
    longest: dict[int, int] = {}
    for n in s.nodes:
        longest[n] = 1 + max((longest[p] for p in g.nodes[n].inputs if p in s), default=0)
    return max(longest.values(), default=0)


def plain_is_convex(s: SubGraph) -> bool:
    reach = s.graph.reach
    below = 0
    for n in plain_exits(s):
        below |= reach[n]
    below &= ~s.mask
    return all(not (reach[o] & s.mask) for o in bits(below))


def plain_is_valid(s: SubGraph, max_exits=None, max_depth=None) -> bool:
    return (
        plain_is_convex(s)
        and (max_exits is None or len(plain_exits(s)) <= max_exits)
        and (max_depth is None or plain_depth(s) <= max_depth)
    )


def plain_touches(s: SubGraph, other: SubGraph) -> bool:
    return any(c in other for n in s.nodes for c in s.graph.consumers[n])


def plain_region_key(graph: DataflowGraph, nodes: tuple[int, ...]) -> str:
    pos = {n: i for i, n in enumerate(nodes)}
    doc = []
    for n in nodes:
        node = graph.nodes[n]
        ins = [
            f"i{pos[p]}" if p in pos else f"x{graph.nodes[p].shapes}{graph.nodes[p].dtypes}"
            for p in node.inputs
        ]
        exit_ = any(c not in pos for c in graph.consumers[n]) or n in graph.outputs
        doc.append((node.op, node.attrs, node.shapes, node.dtypes, node.args, ins, exit_))
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:KEY_DIGITS]


def plain_cheapest_cover(graph, candidates, cost):
    """The DP before it kept one candidate per node set (a copy of the original)."""
    import heapq
    import itertools

    from partune.search.dp import Cover, NoCoverError, input_mask

    full = (1 << len(graph)) - 1
    by_first: dict = {}
    for c in candidates:
        cs = cost(c)
        if cs != float("inf"):
            by_first.setdefault(c.subgraph.nodes[0], []).append((c, cs, input_mask(c)))
    tie = itertools.count()
    best, back = {0: 0.0}, {}
    heap = [(0.0, next(tie), 0)]
    expanded = 0
    while heap:
        so_far, _, covered = heapq.heappop(heap)
        if so_far > best.get(covered, float("inf")):
            continue
        if covered == full:
            picked = []
            while covered:
                covered, c = back[covered]
                picked.append(c)
            return Cover(tuple(reversed(picked)), so_far, expanded)
        expanded += 1
        u = (~covered & (covered + 1)).bit_length() - 1
        for c, cs, inputs in by_first.get(u, ()):
            m = c.subgraph.mask
            if m & covered or inputs & ~covered:
                continue
            nxt, total = covered | m, so_far + cs
            if total < best.get(nxt, float("inf")):
                best[nxt] = total
                back[nxt] = (covered, c)
                heapq.heappush(heap, (total, next(tie), nxt))
    raise NoCoverError("no combination of measured candidates covers the model")


# ----------------------------------------------------------------- graphs


def random_dag(n: int, seed: int) -> DataflowGraph:
    """``n`` nodes, each reading up to three earlier ones (some none), a few outputs."""
    rng = random.Random(seed)
    ops = ["add", "exp", "matmul", "nn.softmax", "tuple", "get_item", "reshape"]
    nodes = []
    for i in range(n):
        k = rng.choice([0, 1, 1, 2, 2, 3]) if i else 0
        inputs = tuple(sorted(rng.sample(range(i), min(k, i))))
        op = rng.choice(ops)
        shape = (rng.choice([1, 4, 8]), 8)
        nodes.append(
            Node(
                i,
                f"v{i}",
                op,
                rng.choice(list(OpKind)),
                inputs,
                (shape,),
                ("float32",),
                rng.randint(0, 99),
                4 * 8 * shape[0],
                f"axis={rng.randint(0, 2)}",
                tuple("node" for _ in inputs),
                4 * 8 * shape[0],
                rng.choice([0, 64]),
            )
        )
    outputs = tuple(sorted({n - 1, *rng.sample(range(n), 2)}))
    return DataflowGraph(tuple(nodes), outputs, ("x",))


def layers(count: int, width: int = 8) -> relax.Function:
    """``count`` identical transformer-like layers: attention scores, softmax, a two-matmul
    feed-forward with a residual add and a layer norm after each half."""
    import numpy as np

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, width), "float32"))
    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float32"))

    op = relax.op
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for _ in range(count):
                q = bb.emit(op.matmul(h, const(width, width)))
                s = bb.emit(op.matmul(q, op.permute_dims(h)))
                p = bb.emit(op.nn.softmax(s, axis=-1))
                a = bb.emit(op.matmul(p, h))
                r = bb.emit(op.add(a, h))
                n1 = bb.emit(op.nn.layer_norm(r, const(width), const(width), axes=[-1]))
                f = bb.emit(
                    op.nn.gelu(op.add(op.matmul(n1, const(width, 2 * width)), const(2 * width)))
                )
                o = bb.emit(op.add(op.matmul(f, const(2 * width, width)), n1))
                h = bb.emit(op.nn.layer_norm(o, const(width), const(width), axes=[-1]))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()["main"]


def _subsets(g: DataflowGraph, rng: random.Random, count: int):
    n = len(g)
    for _ in range(count):
        lo = rng.randrange(n)
        hi = min(n, lo + rng.randint(1, 12))
        picked = [i for i in range(lo, hi) if rng.random() < 0.7] or [lo]
        yield SubGraph.of(g, picked)


# ----------------------------------------------------------------- sub-graphs and keys


@pytest.mark.parametrize("seed", range(6))
def test_subgraph_masks_equal_the_plain_walks(seed):
    g = random_dag(40, seed)
    rng = random.Random(seed)
    subs = list(_subsets(g, rng, 300))
    for s in subs:
        assert s.inputs == plain_inputs(s)
        assert s.entries == plain_entries(s)
        assert s.exits == plain_exits(s)
        assert s.is_convex == plain_is_convex(s)
        assert s.depth == plain_depth(s)
        assert len(s) == len(s.nodes)
        for e, d in ((1, 8), (None, None), (2, 3)):
            assert s.is_valid(e, d) == plain_is_valid(s, e, d)
    for a, b in zip(subs, reversed(subs), strict=True):
        assert a.touches(b) == plain_touches(a, b)
    for i in range(len(g)):  # ancestors is reach, transposed
        assert g.ancestors[i] == sum(1 << j for j in range(len(g)) if g.reach[j] >> i & 1)


def test_non_convex_sets_are_found():
    g = DataflowGraph.from_function(Diamond["main"])
    assert not SubGraph.of(g, [0, 1, 3]).is_convex and not SubGraph.of(g, [0, 2, 3]).is_convex
    assert all(SubGraph.of(g, s).is_convex for s in ([0], [1, 2, 3], [0, 1, 2, 3], [1, 2]))


@pytest.mark.parametrize("seed", range(3))
def test_region_keys_are_the_plain_digests(seed):
    graphs = [
        DataflowGraph.from_function(m["main"]) for m in (Diamond, Residual, TupleGraph, Attention)
    ]
    graphs += [DataflowGraph.from_function(layers(3)), random_dag(50, seed)]
    rng = random.Random(seed)
    for g in graphs:
        for s in [*_subsets(g, rng, 200), SubGraph.of(g, range(len(g)))]:
            want = plain_region_key(g, s.nodes)
            assert region_key(g, s.nodes) == want
            assert region_key(g, s.nodes) == want  # memoised: the same again
            assert region_key(g, list(s.nodes)) == want  # any sequence of the nodes


def test_identical_layers_share_keys():
    g = DataflowGraph.from_function(layers(4))
    one = DataflowGraph.from_function(layers(1))
    per = len(one) - 1  # each layer's nodes, the output alias aside
    assert [n.op for n in g.nodes[per : 2 * per]] == [n.op for n in g.nodes[2 * per : 3 * per]]
    second = [region_key(g, tuple(range(per + a, per + a + 3))) for a in range(per)]
    third = [region_key(g, tuple(range(2 * per + a, 2 * per + a + 3))) for a in range(per)]
    assert second == third


# ----------------------------------------------------------------- rules and the DP


def _plain_subgraphs(monkeypatch):
    """SubGraph as it was: walks instead of masks."""
    monkeypatch.setattr(SubGraph, "inputs", property(plain_inputs))
    monkeypatch.setattr(SubGraph, "entries", property(plain_entries))
    monkeypatch.setattr(SubGraph, "exits", property(plain_exits))
    monkeypatch.setattr(SubGraph, "is_convex", property(plain_is_convex))
    monkeypatch.setattr(SubGraph, "depth", property(plain_depth))
    monkeypatch.setattr(SubGraph, "is_valid", plain_is_valid)
    monkeypatch.setattr(SubGraph, "touches", plain_touches)
    monkeypatch.setattr(SubGraph, "__len__", lambda s: len(s.nodes))


def _proposals(graph, style):
    ok = (lambda n: graph.nodes[n].op != "nn.gelu") if style == "none" else (lambda n: True)
    return [
        (p.subgraph.nodes, p.rule) for p in rule_for_style(style).propose(RuleContext(graph, ok))
    ]


@pytest.mark.parametrize("style", ["none", "tvm", "arbitrary"])
def test_rules_propose_what_the_plain_rules_proposed(style, monkeypatch):
    fast = {}
    for count in (1, 3):
        fast[count] = _proposals(DataflowGraph.from_function(layers(count)), style)
    with monkeypatch.context() as m:
        _plain_subgraphs(m)
        for count in (1, 3):
            assert fast[count] == _proposals(DataflowGraph.from_function(layers(count)), style)


def _layer_candidates(count: int):
    g = DataflowGraph.from_function(layers(count))
    cfg = CompilationConfig.for_cpu(["torch", "onnxruntime"])
    out = []
    for scope, style in zip(cfg.primitives, ("tvm", "none", "arbitrary"), strict=True):
        for p in rule_for_style(style).propose(RuleContext(g, lambda n: True)):
            out.append(Candidate(p.subgraph, scope, p.rule))
    return g, [c for c in out if schedulable(c)]


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_the_plain_dp(seed):
    g, cands = _layer_candidates(3)
    rng = random.Random(seed)
    # Costs shared by node set half the time (ties between scopes), some candidates failed.
    by_mask: dict[int, float] = {}
    costs = {}
    for c in cands:
        base = by_mask.setdefault(c.subgraph.mask, rng.uniform(1, 10) * len(c.subgraph) ** 0.6)
        costs[c] = (
            float("inf")
            if rng.random() < 0.1
            else base
            if rng.random() < 0.5
            else rng.uniform(1, 10)
        )
    rounded = {c: v if v == float("inf") else float(round(v)) for c, v in costs.items()}
    for cost in (costs.__getitem__, rounded.__getitem__):  # rounded: many more ties
        got, want = cheapest_cover(g, cands, cost), plain_cheapest_cover(g, cands, cost)
        assert got.cost_s == want.cost_s and got.states == want.states
        assert [(c.subgraph.mask, c.scope, c.rule) for c in got.candidates] == [
            (c.subgraph.mask, c.scope, c.rule) for c in want.candidates
        ]


def test_candidate_keys_of_repeated_layers_are_shared():
    counts = {}
    for count in (8, 16):
        g, cands = _layer_candidates(count)
        counts[count] = (
            len(cands),
            len({candidate_key(g, c.subgraph.nodes, c.scope) for c in cands}),
        )
    # Twice the layers, twice the candidates, and not one key more: past ``IntervalRule.all_below``
    # blocks, the intervals are as many per layer, and each layer's are the same as the next's.
    assert counts[16][0] > 1.9 * counts[8][0]
    assert counts[16][1] == counts[8][1]
