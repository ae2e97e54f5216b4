"""Store keys never change: a store written by an earlier Partune keeps serving later ones.

The digests below were computed before the one-package redesign; a refactor that moves
code must leave every key byte-identical, or every user's store is silently re-measured.
"""

import hashlib

from partune.core.graph import DataflowGraph
from partune.core.keys import candidate_key, plan_key
from partune.core.plan import single_backend_plan
from partune.core.scopes import CompilationConfig
from partune.search.candidates import enumerate_candidates
from tests.graphs import Attention, Residual

BACKENDS = ["tvm", "torch", "onnxruntime", "openvino"]


def _keys(mod) -> tuple[list[str], list[str]]:
    graph = DataflowGraph.from_function(mod["main"])
    config = CompilationConfig.for_cpu(BACKENDS, threads=1)
    cands = enumerate_candidates(mod, graph, config)
    plans = [
        single_backend_plan("pinned", graph, config, b, set(range(len(graph)))) for b in BACKENDS
    ]
    return sorted(candidate_key(graph, c.subgraph.nodes, c.scope) for c in cands), [
        plan_key(p) for p in plans
    ]


def _digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def test_candidate_and_plan_keys_are_pinned():
    got = {}
    for name, mod in (("residual", Residual), ("attention", Attention)):
        cands, plans = _keys(mod)
        got[name] = (len(cands), _digest(cands), plans)
    assert got == PINNED


PINNED = {
    "residual": (
        39,
        "9cbcb6dcfa8448274af0aaf0f0c80853d1646d43ffed9d7e3eadb9e88676dce9",
        [
            "plan:ecced7d0632f231a91b40144",
            "plan:6ce4b434d021767f67a30ce1",
            "plan:9b514e2323c5f280e11a433a",
            "plan:26b5510a35cc39e8c8280394",
        ],
    ),
    "attention": (
        51,
        "21963e8bede5cf863c908eaef957aecfd8b47f02fc78dbcd25eca6a36cc3ea81",
        [
            "plan:08581d0f4aaef15042eba9d6",
            "plan:900e66f351140d2710e153a4",
            "plan:d96d880ec5fca739cace0cf6",
            "plan:27efa89886ab71c52303e564",
        ],
    ),
}


def test_an_int8_candidate_key_names_the_quantization_scheme():
    """Which ops of an int8 region run in int8 is the scheme's: a region measured under another
    scheme is measured again. An f32 key never carries it (the pinned keys above)."""
    from partune.core import INT8_SCHEME

    graph = DataflowGraph.from_function(Residual["main"])
    config = CompilationConfig.for_cpu(BACKENDS, threads=1, int8=("onnxruntime",))
    int8, f32 = config.scope_for("onnxruntime", "int8"), config.scope_for("onnxruntime")
    assert candidate_key(graph, (0,), int8).endswith(":" + INT8_SCHEME)
    assert INT8_SCHEME not in candidate_key(graph, (0,), f32)
