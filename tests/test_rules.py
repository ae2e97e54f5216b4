"""Partition rules give the expected candidates on small hand-built graphs."""

import pytest

from partune.core.graph import DataflowGraph
from partune.core.subgraph import SubGraph
from partune.search.rules import (
    ARBITRARY_COMBINERS,
    TVM_COMBINERS,
    CombineRule,
    HostRule,
    OnlyValidRule,
    OpKindRule,
    PatternRule,
    RuleContext,
    UnionRule,
    rule_for_style,
)
from tests.graphs import Attention, Diamond, Residual, TupleGraph


def _ctx(mod, accepts=lambda n: True, match=None):
    return RuleContext(DataflowGraph.from_function(mod["main"]), accepts, match)


def _sets(props):
    return {p.subgraph.nodes for p in props}


def test_subgraph_convexity_exits_depth():
    g = DataflowGraph.from_function(Diamond["main"])
    assert not SubGraph.of(g, [0, 1, 3]).is_convex  # 0 -> 2 -> 3 leaves and comes back
    assert SubGraph.of(g, [1, 2, 3]).is_convex
    assert SubGraph.of(g, [0, 1, 2]).exits == (1, 2)
    assert SubGraph.of(g, [0, 1, 2, 3]).depth == 3
    assert SubGraph.of(g, [1, 2]).inputs == (0,)


def test_tvm_style_on_diamond_exactly():
    props = rule_for_style("tvm").propose(_ctx(Diamond))
    # {0, 1} and {0, 2} have two exits (relu feeds both branches): not valid for TVM
    assert _sets(props) == {(0,), (1,), (2,), (3,), (1, 3), (2, 3), (1, 2, 3), (0, 1, 2, 3)}


def test_tvm_style_on_residual_fuses_conv_with_epilogue():
    got = _sets(rule_for_style("tvm").propose(_ctx(Residual)))
    assert (0, 1) in got and (0, 1, 2) in got  # A->B: conv into relu, add
    assert (1, 2, 3) in got  # B->R: element-wise into the reduction
    assert (0, 1, 2, 3) not in got  # an anchor reduction after conv: kinds forbid it


def test_tuple_rules():
    props = rule_for_style("tvm").propose(_ctx(TupleGraph))
    got = _sets(props)
    assert (1,) in got and (4,) in got  # host rule: projections and tuples
    assert (3, 4) in got  # tuple-arg: a tuple joins a field's producer
    assert (0, 1, 2, 3, 4) in got
    assert (0, 1, 2) not in got  # two exits
    assert {p.rule for p in props} >= {"combine[tuple-arg]", "host", "op"}
    assert all(
        len(SubGraph.of(DataflowGraph.from_function(TupleGraph["main"]), s).exits) <= 1 for s in got
    )


def test_arbitrary_style_takes_the_whole_attention_block():
    got = _sets(rule_for_style("arbitrary").propose(_ctx(Attention)))
    assert (0, 1, 2, 3, 4) in got
    # TVM's rules do not fuse through softmax (opaque)
    assert (0, 1, 2, 3, 4) not in _sets(rule_for_style("tvm").propose(_ctx(Attention)))


def test_only_accepted_nodes_are_proposed():
    ctx = _ctx(Attention, accepts=lambda n: n != 3)  # the backend cannot do softmax
    for style in ("none", "tvm", "arbitrary"):
        assert all(3 not in s for s in _sets(rule_for_style(style).propose(ctx)))


def test_pattern_and_composite_rules():
    from tvm.relax.dpl import is_op, wildcard

    from partune.search.candidates import _matcher

    pat = is_op("relax.nn.softmax")(
        is_op("relax.multiply")(is_op("relax.matmul")(wildcard(), wildcard()), wildcard())
    )
    ctx = _ctx(Attention, match=_matcher(Attention["main"]))
    assert _sets(PatternRule(pat).propose(ctx)) == {(1, 2, 3)}
    props = rule_for_style("none", [("mm_scale_softmax", pat)]).propose(ctx)
    assert {p.rule for p in props if p.subgraph.nodes == (1, 2, 3)} == {
        "composite:mm_scale_softmax"
    }


def test_combinators_union_and_only_valid():
    ctx = _ctx(Diamond)
    union = UnionRule([OpKindRule(), HostRule(), OpKindRule()])
    assert len(union.propose(ctx)) == 4
    big = CombineRule(union, ARBITRARY_COMBINERS, max_exits=None, max_depth=None)
    assert (0, 1, 2) in _sets(big.propose(ctx))
    assert (0, 1, 2) not in _sets(OnlyValidRule(big, max_exits=1).propose(ctx))
    assert all(s.subgraph.depth <= 2 for s in OnlyValidRule(big, max_depth=2).propose(ctx))
    assert set(TVM_COMBINERS) == {"A->B", "B->R", "I->I", "tuple-arg", "tuple-proj"}


def test_unknown_style():
    with pytest.raises(ValueError):
        rule_for_style("magic")


def test_interval_rule_proposes_whole_blocks():
    from partune.search.rules import IntervalRule, cut_points
    from tests.graphs import Chain

    assert cut_points(DataflowGraph.from_function(Diamond["main"])) == [0]
    assert _sets(IntervalRule().propose(_ctx(Diamond))) == {(1, 2, 3), (0, 1, 2, 3)}
    chain = _sets(IntervalRule().propose(_ctx(Chain)))
    assert chain == {tuple(range(a, b + 1)) for a in range(8) for b in range(a + 1, 8)}
    # a node the backend refuses splits the intervals, and the maximal runs remain
    got = _sets(IntervalRule().propose(_ctx(Chain, accepts=lambda n: n != 4)))
    assert (0, 1, 2, 3) in got and (5, 6, 7) in got and all(4 not in s for s in got)
    # Past ``all_below`` blocks no proposal spans more than ``max_segments`` of them, the maximal
    # runs included: the whole chain is what the backend's single-backend plan runs.
    windowed = IntervalRule(max_segments=2, all_below=3)
    assert max(map(len, _sets(windowed.propose(_ctx(Chain))))) == 2
    assert max(map(len, _sets(windowed.propose(_ctx(Chain, accepts=lambda n: n != 4))))) == 2
    assert (0, 1, 2, 3, 4, 5, 6, 7) in chain


@pytest.mark.parametrize("shared_rows,cuts_between_blocks", [(128, False), (1, True)])
def test_a_small_value_every_block_reads_does_not_hide_the_blocks(shared_rows, cuts_between_blocks):
    """An attention mask that every layer reads is live across the whole model: counted, it left
    BERT with 6 cut points at any depth. A value far under the median one is not counted; one
    as large as the blocks' own still is."""
    from tvm import relax

    from partune.search.rules import cut_points

    x = relax.Var("x", relax.TensorType((1, 128, 64), "float32"))
    m = relax.Var("m", relax.TensorType((1, shared_rows, 64), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, m]):
        with bb.dataflow():
            shared = bb.emit(relax.op.nn.relu(m))
            h = x
            for _ in range(3):
                h = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(h, shared))))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    g = DataflowGraph.from_function(bb.get()["main"])
    block_ends = [2, 4]  # after the first and the second block's relu
    assert all(p in cut_points(g) for p in block_ends) == cuts_between_blocks


def test_pins_drop_incompatible_candidates(tmp_path):
    from partune.core.scopes import CompilationConfig, SEScope
    from partune.frontend.models import load
    from partune.search.candidates import enumerate_candidates
    from tests.model_files import TVMSCRIPT

    hinted = TVMSCRIPT.replace(
        "z = R.nn.relu(y)",
        "y1 = R.hint_on_device(y, R.device(1, 0))\n            z = R.nn.relu(y1)",
    )
    path = tmp_path / "hinted.py"
    path.write_text(hinted)
    model = load(str(path))
    assert model.pins == {0: SEScope(device_type="cpu", virtual_device_id=0)}  # the matmul
    config = CompilationConfig.for_cpu(["torch", "onnxruntime"])
    free = enumerate_candidates(model.mod, model.graph, config, model.pins)
    assert {c.backend for c in free if 0 in c.subgraph} == {
        "tvm",
        "torch",
        "onnxruntime",
    }  # cpu fits all
    pinned = enumerate_candidates(model.mod, model.graph, config, {0: SEScope(backend="torch")})
    assert {c.backend for c in pinned if 0 in c.subgraph} == {"torch"}
    assert {c.backend for c in pinned if 0 not in c.subgraph} == {"tvm", "torch", "onnxruntime"}
    on_gpu = enumerate_candidates(model.mod, model.graph, config, {0: SEScope(device_type="cuda")})
    assert not [c for c in on_gpu if 0 in c.subgraph]  # no CPU scope may take a GPU-pinned node
