"""Nothing that crosses to a measuring process is unpickled: requests, replies and peers.

A pickle runs whatever it was built to run when it is read. A measuring process (a local
worker, or an RPC server on another machine) must only ever read data: JSON for requests
and replies, and peers as ONNX files, zoo names or ExportedProgram archives read with
torch's weights-only unpickler forced.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from partune.frontend.exported_program import load_program
from partune.runners import peers
from partune.runners.protocol import reply_from_json


class _Touch:
    """A pickle that creates a file when it is read: proof, if the file appears, that
    something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_the_local_worker_answers_a_pickle_with_an_error_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Touch(marker))
    proc = subprocess.Popen(
        [sys.executable, "-m", "partune.runners.worker_main"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout.read(4) == b"RDY!"
        proc.stdin.write(struct.pack("<I", len(data)) + data)
        proc.stdin.flush()
        size = struct.unpack("<I", proc.stdout.read(4))[0]
        reply = reply_from_json(json.loads(proc.stdout.read(size)))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert reply.kind == "measurement" and not reply.measurement.ok
    assert "JSON" in str(reply.measurement.error) or "Expecting" in str(reply.measurement.error)
    assert not marker.exists()


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _pt2(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.pt2"
    torch.export.save(torch.export.export(_Tiny().eval(), (torch.randn(1, 4),)), str(path))
    return path


def _spec_round_trip(spec: dict) -> dict:
    return json.loads(json.dumps(spec))  # what the wire carries is JSON, nothing else


def test_a_pt2_models_torch_peer_travels_as_data_and_matches_the_reference(tmp_path):
    from partune.frontend.models import load_pt2

    model = load_pt2(_pt2(tmp_path))
    specs = peers.peer_specs(model, ("torch",))
    (spec,) = specs.values()
    assert spec["kind"] == "torch" and set(spec["module"]) == {"pt2", "digest"}
    run = peers.make_peer(_spec_round_trip(spec), model.inputs, threads=1)
    np.testing.assert_allclose(run().numpy(), model.reference[0], rtol=1e-5, atol=1e-6)


def test_a_rebuilt_module_with_other_weights_is_refused(tmp_path):
    from partune.frontend.models import load_pt2

    model = load_pt2(_pt2(tmp_path))
    spec = peers.peer_specs(model, ("torch",))[peers.peer_label("torch", model)]
    spec["module"]["digest"] = "0" * 16
    with pytest.raises(RuntimeError, match="differ"):
        peers.make_peer(spec, model.inputs, threads=1)


def test_a_zoo_models_torch_peer_is_rebuilt_by_name():
    from partune.frontend.models import load_zoo

    model = load_zoo("bert-small")
    spec = peers.peer_specs(model, ("torch",))[peers.peer_label("torch", model)]
    assert set(spec["module"]) == {"zoo", "digest"} and spec["module"]["zoo"] == "bert-small"
    out = peers.make_peer(_spec_round_trip(spec), model.inputs, threads=1)()
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    np.testing.assert_allclose(out.numpy(), model.reference[0], rtol=1e-4, atol=1e-5)


def test_a_module_without_a_recipe_is_an_unavailable_peer_not_a_pickle():
    model = type(
        "M", (), {"onnx_bytes": None, "torch_module": _Tiny(), "torch_recipe": None, "name": "m"}
    )()
    spec = peers.peer_specs(model, ("torch",))[peers.peer_label("torch", model)]
    assert spec["kind"] == "unavailable" and "without pickle" in spec["why"]


def _with_hidden_pickle(archive: bytes, marker: Path) -> bytes:
    """A .pt2 archive whose torch.load'ed member is replaced by a pickle that touches ``marker``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        tensor_files = [i.filename for i in src.infolist() if i.filename.endswith(".pt")]
        assert tensor_files, "the archive layout changed: find the torch.load'ed member"
        for info in src.infolist():
            payload = src.read(info.filename)
            if info.filename in tensor_files:
                buf = io.BytesIO()
                torch.save(_Touch(marker), buf)
                payload = buf.getvalue()
            dst.writestr(info, payload)
    return out.getvalue()


def test_an_exported_program_hiding_a_pickle_is_not_run(tmp_path):
    """torch.export.load falls back to full unpickling when the weights-only one refuses
    (checked by hand: plain ``torch.export.load`` on this archive creates the marker);
    ``load_program`` forces the weights-only one, so the hidden pickle never runs."""
    marker = tmp_path / "pwned"
    evil = _with_hidden_pickle(_pt2(tmp_path).read_bytes(), marker)
    with pytest.raises(Exception):  # noqa: B017, PT011 - any refusal will do; running it will not
        load_program(evil)
    assert not marker.exists()


def test_partune_refuses_a_pt2_file_hiding_a_pickle(tmp_path, capsys):
    from partune.cli import main

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt2"
    evil.write_bytes(_with_hidden_pickle(_pt2(tmp_path).read_bytes(), marker))
    assert main(["run", str(evil)]) == 2
    assert "cannot read ExportedProgram" in capsys.readouterr().err
    assert not marker.exists()
