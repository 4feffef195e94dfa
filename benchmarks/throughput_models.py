"""The models the pipelined-throughput benchmark trains: a ResNet-50 and GPT-2 small, random weights.

* :class:`ResNet`: the standard ResNet-50 (bottleneck blocks ``[3, 4, 6, 3]``,
  widths 64-512 with expansion 4, batch norm, a 7x7 stem and max pooling, global
  average pooling and a 1000-way ``fc``), written here because torchvision's
  wheel does not import beside the CPU torch of this environment. The tiny
  variant (``--quick``) has one block per layer and widths 8-64.
* :class:`LMLogits`: Hugging Face's ``GPT2LMHeadModel`` with GPT-2 small's
  config (12 layers, hidden 768, 12 heads, vocabulary 50257, 1024 positions,
  tied head), no dropout, called without a cache; it returns the logits only,
  so a pipeline's last stage hands a tensor to the loss. The tiny variant has
  2 layers, hidden 64 and a vocabulary of 512.

``hand_pins`` gives the hand split each model is compared against: the PyTorch
model-parallel tutorial's ResNet-50 split (stem, ``layer1``, ``layer2`` on the
first device; ``layer3``, ``layer4``, ``fc`` on the second) and its analogue
for GPT-2 (embeddings and the first half of the blocks | the second half, the
final norm and the head, whose weight is tied to the token embedding: the
pipeline replicates it on both stages); on four devices, one ResNet layer or
a quarter of GPT-2's blocks per device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "Bottleneck", "LMLogits", "ModelSpec", "ResNet", "batched", "hand_pins", "model_spec"]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand; projection shortcut where shapes change."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(y + shortcut)


class ResNet(nn.Module):
    """ResNet with bottleneck blocks; ``ResNet()`` is ResNet-50 (25.6 M parameters)."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        layers = []
        for index, count in enumerate(blocks):
            planes = width * 2**index
            stride = 1 if index == 0 else 2
            layer = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * Bottleneck.expansion
            layer += [Bottleneck(inplanes, planes) for _ in range(count - 1)]
            layers.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LMLogits(nn.Module):
    """A causal language model called without a cache, returning its logits (a tensor, not a ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def _gpt2(layers: int, hidden: int, heads: int, vocab: int) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return LMLogits(transformers.GPT2LMHeadModel(config))


@dataclass(frozen=True)
class ModelSpec:
    """One model of the benchmark, full size or tiny, and its training data.

    Attributes:
        name: ``resnet50`` or ``gpt2``.
        tiny: the ``--quick`` variant.
        build: a fresh model, the same random weights every call.
        batch: samples per training step (split into ``chunks`` micro-batches).
        inputs: one batch of inputs and targets, seeded by step.
        blocks: the names of the model's repeated blocks, in order (for the hand split).
        trace: how fxsplit traces it (``"fx"`` or ``"export"``).
        describe: one line for the results.
    """

    name: str
    tiny: bool
    build: Callable[[], nn.Module]
    batch: int
    inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    blocks: tuple[str, ...]
    trace: str
    describe: str


def _images(batch: int, size: int, classes: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        return torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, classes, (batch,), generator=gen)

    return make


def _tokens(batch: int, length: int, vocab: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(2000 + step)
        ids = torch.randint(0, vocab, (batch, length + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return make


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build().train()

    return make


def _resnet_blocks(counts: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"layer{i + 1}.{j}" for i, count in enumerate(counts) for j in range(count))


IMAGE, IMAGE_TINY, SEQ, SEQ_TINY = 96, 32, 32, 16

MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "resnet50",
        False,
        _seeded(ResNet),
        16,
        _images(16, IMAGE, 1000),
        _resnet_blocks((3, 4, 6, 3)),
        "fx",
        f"ResNet-50 (bottleneck blocks [3, 4, 6, 3], 25.6 M parameters), {IMAGE}x{IMAGE} images, batch 16",
    ),
    ModelSpec(
        "gpt2",
        False,
        _seeded(lambda: _gpt2(12, 768, 12, 50257)),
        8,
        _tokens(8, SEQ, 50257),
        tuple(f"model.transformer.h.{i}" for i in range(12)),
        "export",
        f"GPT-2 small (12 layers, hidden 768, vocabulary 50257, 124 M parameters), {SEQ} tokens, batch 8",
    ),
    ModelSpec(
        "resnet50",
        True,
        _seeded(lambda: ResNet((1, 1, 1, 1), width=8, classes=10)),
        8,
        _images(8, IMAGE_TINY, 10),
        _resnet_blocks((1, 1, 1, 1)),
        "fx",
        f"tiny ResNet (one bottleneck block per layer, widths 8-64), {IMAGE_TINY}x{IMAGE_TINY} images, batch 8",
    ),
    ModelSpec(
        "gpt2",
        True,
        _seeded(lambda: _gpt2(2, 64, 4, 512)),
        8,
        _tokens(8, SEQ_TINY, 512),
        ("model.transformer.h.0", "model.transformer.h.1"),
        "export",
        f"tiny GPT-2 (2 layers, hidden 64, vocabulary 512), {SEQ_TINY} tokens, batch 8",
    ),
)


def batched(spec: ModelSpec, batch: int) -> ModelSpec:
    """``spec`` training on batches of ``batch`` samples (same model, same kind of data)."""
    if spec.name == "resnet50":
        inputs = _images(batch, IMAGE_TINY if spec.tiny else IMAGE, 10 if spec.tiny else 1000)
    else:
        inputs = _tokens(batch, SEQ_TINY if spec.tiny else SEQ, 512 if spec.tiny else 50257)
    describe = spec.describe.replace(f"batch {spec.batch}", f"batch {batch}")
    return replace(spec, batch=batch, inputs=inputs, describe=describe)


def model_spec(name: str, tiny: bool) -> ModelSpec:
    for spec in MODELS:
        if spec.name == name and spec.tiny == tiny:
            return spec
    raise SystemExit(f"unknown throughput model {name!r}; models are {', '.join(sorted({m.name for m in MODELS}))}")


def hand_pins(spec: ModelSpec, devices: tuple[str, ...]) -> dict[str, str]:
    """A hand split as fxsplit pins: 2 devices, the tutorial's (ResNet) or half/half (GPT-2); 4, by layer or quarter.

    ResNet on 4 devices: stem and ``layer1`` | ``layer2`` | ``layer3`` | ``layer4`` and ``fc``.
    GPT-2: the blocks in equal runs, the embeddings with the first, the final norm and the head with the last.
    """
    groups: tuple[tuple[str, ...], ...]
    if spec.name == "resnet50":
        groups = {
            2: (("conv1", "bn1", "maxpool", "layer1", "layer2"), ("layer3", "layer4", "fc")),
            4: (("conv1", "bn1", "maxpool", "layer1"), ("layer2",), ("layer3",), ("layer4", "fc")),
        }[len(devices)]
    else:
        size = len(spec.blocks) // len(devices)
        runs = [list(spec.blocks[i * size : (i + 1) * size]) for i in range(len(devices))]
        runs[-1] += list(spec.blocks[len(devices) * size :])
        runs[0] = ["model.transformer.wte", "model.transformer.wpe", *runs[0]]
        runs[-1] += ["model.transformer.ln_f", "model.lm_head"]
        groups = tuple(tuple(run) for run in runs)
    return {name: device for device, group in zip(devices, groups, strict=True) for name in group}
