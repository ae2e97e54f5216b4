"""Built-in model zoo: real architectures from Hugging Face config objects, seeded weights.

Nothing is downloaded: every model is built from a ``transformers`` config with random
weights drawn from a fixed seed, then made numerically sane (BatchNorm statistics
calibrated on random inputs, zero-initialised layers re-drawn) so that a reference
check against the outputs means something. Each architecture has a full-size variant
and a ``-small`` one that is fast enough for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SEED = 0


@dataclass(frozen=True)
class ZooEntry:
    """How to build one zoo model and its example inputs."""

    name: str
    family: str  # "cnn" or "transformer"
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    description: str


class _FirstOutput(torch.nn.Module):
    """Wraps a Hugging Face model so it returns one tensor (logits or last hidden state)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args, return_dict=False)
        return out[0]


def _sanitise(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.nn.Module:
    """Make random weights give O(1) outputs: redraw all-zero weights, calibrate BN."""
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and torch.count_nonzero(p) == 0:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
            elif name.endswith("bias") and torch.count_nonzero(p) == 0:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if bns:
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average over the calibration batches
        model.train()
        with torch.no_grad():
            for i in range(4):
                g = torch.Generator().manual_seed(SEED + 10 + i)
                batch = tuple(
                    torch.randn((4, *x.shape[1:]), generator=g) if x.is_floating_point() else x
                    for x in inputs
                )
                model(*batch)
    return model.eval()


def _image(size: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn((1, 3, size, size), generator=torch.Generator().manual_seed(SEED)),)


def _tokens(seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (
        torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(SEED)),
    )


def _hf(
    config_factory: Callable[[], object],
    head: str,
    image: int | None = None,
    seq: int | None = None,
) -> tuple[Callable[[], torch.nn.Module], Callable]:
    import transformers

    inputs = _image(image) if image else _tokens(seq, config_factory().vocab_size)

    def build() -> torch.nn.Module:
        torch.manual_seed(SEED)
        config = config_factory()
        config.attn_implementation = "eager"
        model = getattr(transformers, head)(config)
        wrapped = _FirstOutput(model).eval()
        return _sanitise(wrapped, inputs())

    return build, inputs


def _resnet(small: bool):
    from transformers import ResNetConfig

    def cfg():
        if small:
            return ResNetConfig(
                embedding_size=16,
                hidden_sizes=[16, 32, 64, 128],
                depths=[1, 1, 1, 1],
                layer_type="bottleneck",
                num_labels=10,
            )
        return ResNetConfig(num_labels=1000)  # resnet-50

    return _hf(cfg, "ResNetForImageClassification", image=64 if small else 224)


def _mobilenet(small: bool):
    from transformers import MobileNetV2Config

    def cfg():
        return MobileNetV2Config(
            depth_multiplier=0.35 if small else 1.0,
            image_size=64 if small else 224,
            num_labels=10 if small else 1000,
        )

    return _hf(cfg, "MobileNetV2ForImageClassification", image=64 if small else 224)


def _convnext(small: bool):
    from transformers import ConvNextConfig

    def cfg():
        if small:
            return ConvNextConfig(
                hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10
            )
        return ConvNextConfig(
            hidden_sizes=[40, 80, 160, 320], depths=[2, 2, 6, 2], num_labels=1000
        )  # atto

    return _hf(cfg, "ConvNextForImageClassification", image=64 if small else 224)


def _vit(small: bool):
    from transformers import ViTConfig

    def cfg():
        if small:
            return ViTConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                image_size=32,
                patch_size=8,
                num_labels=10,
            )
        return ViTConfig(
            hidden_size=192,
            num_hidden_layers=12,
            num_attention_heads=3,
            intermediate_size=768,
            image_size=224,
            patch_size=16,
            num_labels=1000,
        )  # vit-tiny

    return _hf(cfg, "ViTForImageClassification", image=32 if small else 224)


def _bert(small: bool):
    from transformers import BertConfig

    def cfg():
        if small:
            return BertConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                vocab_size=512,
                max_position_embeddings=64,
            )
        return BertConfig(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=30522,
            max_position_embeddings=512,
        )  # bert 4x256

    return _hf(cfg, "BertModel", seq=32 if small else 128)


def _gpt2(small: bool):
    from transformers import GPT2Config

    def cfg():
        if small:
            return GPT2Config(
                n_embd=64, n_layer=2, n_head=2, vocab_size=512, n_positions=64, use_cache=False
            )
        return GPT2Config(
            n_embd=256, n_layer=4, n_head=4, vocab_size=50257, n_positions=256, use_cache=False
        )

    return _hf(cfg, "GPT2Model", seq=32 if small else 128)


_FAMILIES: dict[str, tuple[str, Callable, str]] = {
    "resnet50": ("cnn", _resnet, "ResNet-50 (bottleneck), 224x224"),
    "mobilenet_v2": ("cnn", _mobilenet, "MobileNetV2 1.0, 224x224"),
    "convnext": ("cnn", _convnext, "ConvNeXt-atto, 224x224"),
    "vit": ("transformer", _vit, "ViT-tiny/16, 224x224"),
    "bert": ("transformer", _bert, "BERT 4 layers x 256, seq 128"),
    "gpt2": ("transformer", _gpt2, "GPT-2 4 layers x 256, seq 128"),
}


def _entries() -> dict[str, ZooEntry]:
    out = {}
    for name, (family, factory, desc) in _FAMILIES.items():
        for small in (False, True):
            key = f"{name}-small" if small else name
            build, inputs = factory(small)
            out[key] = ZooEntry(
                key, family, build, inputs, desc + (" (small test variant)" if small else "")
            )
    return out


ZOO: dict[str, ZooEntry] = _entries()


def names() -> list[str]:
    """All zoo model names, full-size and small variants."""
    return sorted(ZOO)
