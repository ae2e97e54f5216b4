"""Small exports with symbolic axes, as users' files declare them: a masked encoder (batch and
sequence, an attention mask) and a CNN (batch)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
from torch import nn


class MaskedEncoder(nn.Module):
    """Token embedding, one attention layer whose keys the mask hides, a projection."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.scale = dim**-0.5

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores + (1.0 - attention_mask[:, None, :].to(h.dtype)) * -1e9
        return self.out(torch.softmax(scores, dim=-1) @ v) + h


def _export(module: nn.Module, args: tuple, names: list[str], dynamic: dict, path: Path) -> Path:
    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            args,
            buf,
            dynamo=False,
            input_names=names,
            output_names=["y"],
            opset_version=17,
            dynamic_axes=dynamic,
        )
    path.write_bytes(buf.getvalue())
    return path


def write_masked_encoder(path: Path) -> Path:
    torch.manual_seed(0)
    module = MaskedEncoder()
    ids = torch.randint(0, 50, (1, 8))
    axes = {0: "batch", 1: "sequence"}
    return _export(
        module,
        (ids, torch.ones(1, 8, dtype=torch.int64)),
        ["input_ids", "attention_mask"],
        {"input_ids": axes, "attention_mask": axes, "y": axes},
        path,
    )


def write_batched_cnn(path: Path) -> Path:
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4)
    )
    return _export(
        module, (torch.randn(1, 3, 8, 8),), ["x"], {"x": {0: "batch"}, "y": {0: "batch"}}, path
    )
