import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from partune.core.graph import DataflowGraph, OpKind


@I.ir_module
class Diamond:
    @R.function
    def main(x: R.Tensor((1, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32")):
        with R.dataflow():
            a = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            b = R.nn.relu(a)
            c = R.split(b, 2, axis=1)
            d = c[0]
            e = c[1]
            f = R.add(d, e)
            g = R.sum(f, axis=[2, 3])
            R.output(g)
        return g


def test_nodes_kinds_edges_and_costs():
    g = DataflowGraph.from_function(Diamond["main"])
    assert [n.op for n in g.nodes] == [
        "nn.conv2d",
        "nn.relu",
        "split",
        "get_item",
        "get_item",
        "add",
        "sum",
    ]
    assert [n.kind for n in g.nodes] == [
        OpKind.OUT_ELEMWISE_FUSABLE,
        OpKind.ELEMWISE,
        OpKind.INJECTIVE,
        OpKind.INJECTIVE,
        OpKind.INJECTIVE,
        OpKind.ELEMWISE,
        OpKind.REDUCTION,
    ]
    assert g.nodes[0].inputs == ()  # params are not nodes
    assert g.nodes[5].inputs == (3, 4)
    assert g.consumers[2] == (3, 4)
    assert g.outputs == (6,)
    assert g.nodes[0].flops == 2 * (1 * 4 * 8 * 8) * (3 * 3 * 3)
    assert g.nodes[2].shapes == ((1, 2, 8, 8), (1, 2, 8, 8))
    assert g.nodes[0].bytes == 4 * (3 * 64 + 4 * 27 + 4 * 64)
    for n in g.nodes:  # post-DFS: producers come first
        assert all(i < n.index for i in n.inputs)


def test_fingerprint_is_stable_and_sensitive(bert, resnet):
    g = DataflowGraph.from_function(Diamond["main"])
    assert g.fingerprint == DataflowGraph.from_function(Diamond["main"]).fingerprint
    assert bert.graph.fingerprint != resnet.graph.fingerprint
    mod = tvm.IRModule({"main": Diamond["main"]})
    changed = relax.transform.DeadCodeElimination()(mod)
    assert DataflowGraph.from_function(changed["main"]).fingerprint == g.fingerprint


def test_zoo_graphs_have_costs(bert, resnet):
    for model in (bert, resnet):
        assert sum(n.flops for n in model.graph.nodes) > 1e6
        assert all(n.bytes >= 0 for n in model.graph.nodes)
        assert model.graph.outputs
