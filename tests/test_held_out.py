"""The held-out architectures export, import and compute what torch computes.

They are benchmarked only (``bench_vs_peers.py --held-out``) and no tuning decision may use
them, so all that is held here is that each one is a valid benchmark input: the legacy
export imports with ``load_onnx``, and the reference outputs the imported model carries
(onnxruntime on the file) are torch eager's outputs on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments import architectures as A
from experiments.bench_vs_peers import EXPORTS
from partune.frontend.models import load_onnx


def test_the_held_out_set_stays_apart():
    assert len(A.HELD_OUT) == 3 and all(n in A.ARCHITECTURES for n in A.HELD_OUT)
    assert not set(A.HELD_OUT) & (set(EXPORTS) | set(A.names()))


@pytest.mark.parametrize("name", A.HELD_OUT)
def test_held_out_export_imports_and_matches_torch(name, tmp_path):
    arch = A.get(name)
    module, inputs = arch.build()
    A.export_onnx(arch, tmp_path / f"{name}.onnx", exporter="legacy")
    model = load_onnx(
        tmp_path / f"{name}.onnx",
        {n: tuple(x.shape) for n, x in zip(arch.input_names, inputs, strict=True)},
    )
    (ref,) = model.reference
    assert np.isfinite(ref).all() and 0.1 < float(np.abs(ref).max()) < 100  # O(1) outputs
    scale = float(np.abs(ref).max())
    with torch.no_grad():
        eager = module(*(torch.from_numpy(x) for x in model.inputs)).numpy()
    assert float(np.abs(eager - ref).max()) < 1e-3 * scale
