"""Tiny export-style ONNX test models: one troublesome pattern each, as ``torch.onnx.export`` writes
it.

Hand-written ONNX graphs (tests/model_files.py) carry constant shapes; real exports do not. With
the batch (and sequence) axis marked dynamic, the exporter computes reshape targets at run time
(Shape -> Gather -> Unsqueeze -> Concat -> Reshape), and the Relax importer must fold them. Each
model here is a few dozen ONNX nodes with seeded weights, so a test can export, import and run
it in about a second. Nothing is downloaded.

Convention (same as experiments/architectures.py): 4-D float inputs are images named ``x`` with
a dynamic batch axis; other inputs are sequences (``x`` float, ``input_ids`` int64) with dynamic
batch and sequence axes. The single output is ``y`` with the same dynamic axes.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import nn

SEED = 0
VOCAB = 100


def _gen(offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def _image(c: int = 4, hw: int = 8) -> tuple[torch.Tensor, ...]:
    return (torch.randn((1, c, hw, hw), generator=_gen()),)


def _sequence(seq: int = 8, dim: int = 32) -> tuple[torch.Tensor, ...]:
    return (torch.randn((1, seq, dim), generator=_gen()),)


# --------------------------------------------------------------------------- models


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """torchvision's ShuffleNetV2 shuffle: sizes from x.size(), so the reshapes are computed."""
    batchsize, num_channels, height, width = x.size()
    x = x.view(batchsize, groups, num_channels // groups, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


class ChannelShuffle(nn.Module):
    """1x1 conv, shuffle, then the next unit's channel split (chunk) and depthwise branch.

    The split after the shuffle is what breaks a Relax import without shape folding: ``chunk``
    exports as Slices whose bounds come from Shape/Gather/Div of the shuffled tensor
    ("emit_te now only supports Tensor that has ShapeExpr shape").
    """

    def __init__(self) -> None:
        super().__init__()
        self.pw = nn.Conv2d(4, 8, 1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = channel_shuffle(torch.relu(self.pw(x)), 2).chunk(2, dim=1)
        return torch.cat((x1, self.dw(x2)), dim=1)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's stride-1 unit as torchvision writes it: split the input, branch, concat,
    shuffle. Splitting a graph input with computed bounds fails differently from a split
    inside the graph ("shape_of expects a tensor input, but received R.Shape")."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=1)
        return channel_shuffle(torch.cat((x1, torch.relu(self.branch(x2))), dim=1), 2)


class ComputedReshape(nn.Module):
    """Conv features flattened with ``x.view(x.size(0), -1)`` into a Linear (classic head)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x))
        return self.fc(x.view(x.size(0), -1))


class HeadReshape(nn.Module):
    """Attention-style split/merge of heads with (b, s) read from x.shape, between Linears."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.proj(x).reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
        h = torch.softmax(h, dim=-1).transpose(1, 2).reshape(b, s, d)
        return self.out(h)


class ComputedSlice(nn.Module):
    """A slice bound that is arithmetic on a dynamic size (``h[:, s // 2:]``, like trimming a
    mask or keeping the last positions). The dynamo exporter writes Shape -> Squeeze -> Div ->
    Reshape -> Slice, and a Relax import without shape folding fails on the Reshape of a
    scalar ("Reshape expects the input data to be a Tensor ... ir.PrimType"). Non-empty for
    every sequence length, 1 included."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, x.shape[1] // 2 :]


class HardActivations(nn.Module):
    """hardswish after a conv, then a hardsigmoid gate, as in MobileNetV3."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.hardswish(self.conv1(x))
        return x * nn.functional.hardsigmoid(self.conv2(x))


class SqueezeExcite(nn.Module):
    """Squeeze-excitation: adaptive avg pool, 1x1 convs, ReLU, gate scales the input."""

    def __init__(self, channels: int, squeeze: int, gate: nn.Module) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(torch.relu(self.fc1(self.pool(x)))))


class SEBlock(nn.Module):
    """Conv then two SE blocks: sigmoid gate (EfficientNet) and hardsigmoid gate (MobileNetV3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3, padding=1)
        self.se1 = SqueezeExcite(16, 4, nn.Sigmoid())
        self.se2 = SqueezeExcite(16, 8, nn.Hardsigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se2(self.se1(torch.relu(self.conv(x))))


class GeluMLP(nn.Module):
    """Both GELU forms: exact (erf, BERT) and tanh approximation (GPT-2)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, 2 * dim)
        self.fc3 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.fc1(x))
        x = nn.functional.gelu(self.fc2(x), approximate="tanh")
        return self.fc3(x)


class LayerNormBlock(nn.Module):
    """Pre-norm residual MLP: LayerNorm over the last axis (ONNX LayerNormalization)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(x + self.fc(self.norm1(x)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotate_half: slice the last axis in two halves, negate and swap them."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Llama-style RoPE: cos/sin tables from arange(seq) and inv_freq, rotate_half (q only,
    to stay small; k is rotated identically in Llama)."""

    def __init__(self, dim: int = 32, heads: int = 2, base: float = 10000.0) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        inv_freq = 1.0 / base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.q = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        return self.o(q.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class EmbeddingMLP(nn.Module):
    """nn.Embedding gather on int64 ids, then a small GELU MLP."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(self.embed(input_ids))))


def _seeded(
    factory: Callable[[], nn.Module], inputs: Callable[[], tuple[torch.Tensor, ...]]
) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """A builder that seeds torch before creating the module, so weights are reproducible."""

    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        torch.manual_seed(SEED)
        return factory().eval(), inputs()

    return build


TEST_MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "channel_shuffle": _seeded(ChannelShuffle, _image),
    "shuffle_unit": _seeded(ShuffleUnit, _image),
    "computed_reshape": _seeded(ComputedReshape, _image),
    "head_reshape": _seeded(HeadReshape, _sequence),
    "computed_slice": _seeded(ComputedSlice, _sequence),
    "hardswish_hardsigmoid": _seeded(HardActivations, _image),
    "se_block": _seeded(SEBlock, _image),
    "gelu": _seeded(GeluMLP, _sequence),
    "layer_norm": _seeded(LayerNormBlock, _sequence),
    "rotary": _seeded(Rotary, _sequence),
    "embedding_mlp": _seeded(
        EmbeddingMLP,
        lambda: (torch.randint(0, VOCAB, (1, 8), generator=_gen(), dtype=torch.int64),),
    ),
}


# --------------------------------------------------------------------------- export


def io_spec(inputs: tuple[torch.Tensor, ...]) -> tuple[list[str], dict[str, dict[int, str]]]:
    """Input names and dynamic axes by the convention in the module docstring."""
    names: list[str] = []
    dynamic: dict[str, dict[int, str]] = {}
    for i, x in enumerate(inputs):
        base = "x" if x.is_floating_point() else "input_ids"
        name = base if len(inputs) == 1 else f"{base}{i}"
        names.append(name)
        dynamic[name] = {0: "batch"} if x.dim() == 4 else {0: "batch", 1: "sequence"}
    dynamic["y"] = dynamic[names[0]]
    return names, dynamic


def export_bytes(
    name: str, exporter: Literal["legacy", "dynamo"] = "legacy", opset: int | None = None
) -> bytes:
    """Export test model ``name`` as a user would, dynamic axes marked; return the ONNX bytes.

    ``legacy`` (TorchScript, ``dynamo=False``) is the exporter that emits the computed shapes.
    """
    import onnx

    module, inputs = TEST_MODELS[name]()
    names, dynamic = io_spec(inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            buf = io.BytesIO()
            torch.onnx.export(
                module,
                inputs,
                buf,
                dynamo=False,
                input_names=names,
                output_names=["y"],
                opset_version=opset or 17,
                dynamic_axes=dynamic,
            )
            proto = onnx.load_from_string(buf.getvalue())
        else:
            # size-1 dims would be specialised by torch.export; trace at 2 (see architectures.py)
            traced = tuple(torch.cat([x, x], 0) for x in inputs)
            shapes = tuple({ax: torch.export.Dim.DYNAMIC for ax in dynamic[n]} for n in names)
            proto = torch.onnx.export(
                module,
                traced,
                None,
                dynamo=True,
                input_names=names,
                output_names=["y"],
                opset_version=opset or 18,
                dynamic_shapes=shapes,
                verbose=False,
            ).model_proto
    for vi in [*proto.graph.input, *proto.graph.output]:
        for ax, d in enumerate(vi.type.tensor_type.shape.dim):
            if ax in dynamic.get(vi.name, {}) and not d.HasField("dim_value"):
                d.dim_param = dynamic[vi.name][ax]
    meta = proto.metadata_props.add()
    meta.key = "example_input_shapes"
    meta.value = json.dumps({n: list(x.shape) for n, x in zip(names, inputs, strict=True)})
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def write_export(name: str, path: Path, exporter: Literal["legacy", "dynamo"] = "legacy") -> Path:
    """Write test model ``name`` to ``path`` (a .onnx file, or a directory for NAME.onnx)."""
    path = Path(path)
    if path.suffix != ".onnx":
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"{name}.onnx"
    path.write_bytes(export_bytes(name, exporter))
    return path
