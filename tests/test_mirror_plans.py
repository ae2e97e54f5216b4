"""The graph-level backends' own plans mirror the library on the user's file.

onnxruntime on the user's file is a peer; the onnxruntime-only plan is Partune's import
of that file translated back to ONNX. Where the import or the translation loses
something the library needs (a conv1d it cannot translate, a bias split off a
ConvTranspose, a HardSwish spelt as a chain), the mirror runs slower than the file and
no plan built on it can win. Timing belongs in the benchmark (``make bench``); what is
held here is its structural cause, on ONNX exports of architectures the zoo does not
hold: the library takes the whole model as one region, and after onnxruntime's own
graph optimisations the translation leaves it no more kernels than the user's file.
"""

from __future__ import annotations

from collections import Counter

import onnx
import onnxruntime as ort
import pytest

from experiments import architectures as A
from partune.backends.onnxruntime_backend import DISABLED_OPTIMIZERS, session_options
from partune.backends.relax_onnx import relax_to_onnx
from partune.core.scopes import CompilationConfig
from partune.frontend.models import load_onnx
from partune.search.candidates import backend_plan

# Every export architecture of the benchmark (legacy exporter: quick; the dynamo exports are
# in `make bench`, where both mirrors are timed against the file).
ARCHITECTURES = [
    "mobilenet_v3_small",
    "shufflenet_v2",
    "squeezenet1_1",
    "convnext_atto",
    "distilbert",
    "llama",
    "densenet",
    "unet",
    "efficientnet",
    "mobilevit",
    "whisper_encoder",
    "wav2vec2",
    "phi",
    "deberta",
]
METADATA = {"Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze"}  # no pass over the data


def _kernels(data: bytes, path) -> Counter:
    """The nodes onnxruntime runs after its graph optimisations, metadata ops aside."""
    so = session_options(1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    so.optimized_model_filepath = str(path)
    ort.InferenceSession(
        data, so, providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_OPTIMIZERS)
    )
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node if n.op_type not in METADATA)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_onnxruntime_mirror_loses_nothing_of_the_users_file(name, tmp_path):
    arch = A.get(name)
    _, inputs = arch.build()
    data = A.export_onnx(arch, tmp_path / "model.onnx", exporter="legacy")
    model = load_onnx(
        tmp_path / "model.onnx",
        {n: tuple(x.shape) for n, x in zip(arch.input_names, inputs, strict=True)},
    )
    plan = backend_plan(
        model.name,
        model.mod,
        model.graph,
        CompilationConfig.for_cpu(["onnxruntime"]),
        "onnxruntime",
    )
    assert [r.backend for r in plan.regions] == ["onnxruntime"]  # nothing falls back to TVM
    mine = _kernels(relax_to_onnx(model.mod["main"]).SerializeToString(), tmp_path / "mine.onnx")
    theirs = _kernels(data, tmp_path / "theirs.onnx")
    assert sum(mine.values()) <= sum(theirs.values()), (mine - theirs, theirs - mine)
