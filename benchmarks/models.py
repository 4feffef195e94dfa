"""The models the benchmarks run on: Hugging Face transformers from small configs, and stress models.

Every model is built from a config with random weights (seeded; nothing is
downloaded) and put in eval mode. Hugging Face models are called without a
KV cache (``use_cache=False``), the way a split forward runs them.

Stress models are plain PyTorch:

* ``unet``: a U-Net-like conv net whose encoder outputs skip to the far end
  (long skip connections that cross every device boundary);
* ``unet2``: two such U-Nets in a row (a cascade): two sets of skips, so the
  first device cannot simply hold both ends;
* ``branches``: stages of eight parallel MLP branches merged by a projection
  (one value read by many ops, wide fan-in);
* ``mlp48``: 48 blocks of ``Linear`` + ``ReLU`` (a plain chain; also the
  runtime benchmark's model).

``block_classes`` are the class names a user passes to Accelerate as
``no_split_module_classes`` (``model._no_split_modules`` for Hugging Face
models); :func:`top_level_blocks` turns them into the module list the
block-level reference places.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CASES", "Case", "MLPBlock", "case_by_name", "top_level_blocks"]

_SEED = 0
VOCAB = 8192


@dataclass(frozen=True)
class Case:
    """One model and the inputs it is traced and run on.

    Attributes:
        name: short name used in tables and on the command line.
        family: ``"hf"`` (Hugging Face transformers) or ``"stress"`` (plain PyTorch).
        build: returns a fresh model (same weights every call).
        inputs: returns the positional example inputs.
        block_classes: class names of the model's blocks (Accelerate's no-split classes).
        kwargs: returns keyword inputs (``decoder_input_ids`` for T5).
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    block_classes: tuple[str, ...]
    kwargs: Callable[[], dict[str, Any]] = field(default=dict)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(_SEED)
        return make().eval()

    return build


def _ids(batch: int, length: int) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1)),)


def _quiet_transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    return transformers


def gpt2() -> nn.Module:
    t = _quiet_transformers()
    config = t.GPT2Config(
        n_layer=8,
        n_embd=256,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=256,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return t.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    t = _quiet_transformers()
    config = t.BertConfig(
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        use_cache=False,
    )
    return t.BertModel(config)


def llama() -> nn.Module:
    t = _quiet_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return t.LlamaForCausalLM(config)


def vit() -> nn.Module:
    t = _quiet_transformers()
    config = t.ViTConfig(
        num_hidden_layers=8, hidden_size=256, num_attention_heads=4, intermediate_size=1024, image_size=64, patch_size=8
    )
    return t.ViTModel(config)


def t5() -> nn.Module:
    t = _quiet_transformers()
    config = t.T5Config(
        num_layers=4,
        num_decoder_layers=4,
        d_model=256,
        num_heads=4,
        d_kv=64,
        d_ff=1024,
        vocab_size=VOCAB,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return t.T5ForConditionalGeneration(config)


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class UNet(nn.Module):
    """Encoder stages whose outputs are concatenated into the matching decoder stages."""

    def __init__(self, channels: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        ins = (3, *channels[:-1])
        self.down = nn.ModuleList(ConvBlock(i, o) for i, o in zip(ins, channels, strict=True))
        self.mid = ConvBlock(channels[-1], 2 * channels[-1])
        outs = list(reversed(channels))
        below = [2 * channels[-1], *outs[:-1]]
        self.up = nn.ModuleList(ConvBlock(b + o, o) for b, o in zip(below, outs, strict=True))
        self.head = nn.Conv2d(channels[0], 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for block, skip in zip(self.up, reversed(skips), strict=True):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skip], dim=1))
        return self.head(x)


class UNet2(nn.Module):
    """Two U-Nets in a row: each one's skips reach across its own deep middle."""

    def __init__(self) -> None:
        super().__init__()
        self.first = UNet()
        self.second = UNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class BranchBlock(nn.Module):
    """``width`` parallel two-layer MLPs on the same input, concatenated, projected, added back."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)) for _ in range(width)
        )
        self.merge = nn.Linear(dim * width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.merge(torch.cat([branch(x) for branch in self.branches], dim=-1))


class Branches(nn.Module):
    def __init__(self, dim: int = 128, width: int = 8, stages: int = 6) -> None:
        super().__init__()
        self.stages = nn.Sequential(*(BranchBlock(dim, width) for _ in range(stages)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(x)


class MLPBlock(nn.Module):
    """``relu(linear(x))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 48) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(dim) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _randn(*shape: int) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)


CASES: tuple[Case, ...] = (
    Case("gpt2", "hf", _seeded(gpt2), _ids(2, 64), ("GPT2Block",)),
    Case("bert", "hf", _seeded(bert), _ids(2, 64), ("BertEmbeddings", "BertLayer")),
    Case("llama", "hf", _seeded(llama), _ids(2, 64), ("LlamaDecoderLayer",)),
    Case("vit", "hf", _seeded(vit), _randn(2, 3, 64, 64), ("ViTEmbeddings", "ViTLayer")),
    Case("t5", "hf", _seeded(t5), _ids(2, 32), ("T5Block",), kwargs=lambda: {"decoder_input_ids": _ids(2, 16)()[0]}),
    Case("unet", "stress", _seeded(UNet), _randn(2, 3, 64, 64), ("ConvBlock",)),
    Case("unet2", "stress", _seeded(UNet2), _randn(2, 3, 64, 64), ("ConvBlock",)),
    Case("branches", "stress", _seeded(Branches), _randn(32, 128), ("BranchBlock",)),
    Case("mlp48", "stress", _seeded(MLP), _randn(16, 256), ("MLPBlock",)),
)


def case_by_name(name: str) -> Case:
    """The case called ``name``; raises ``ValueError`` naming the known cases."""
    for case in CASES:
        if case.name == name:
            return case
    raise ValueError(f"unknown model {name!r}; known: {', '.join(c.name for c in CASES)}")


def top_level_blocks(model: nn.Module, block_classes: tuple[str, ...]) -> list[str]:
    """Module paths of the model's top-level blocks, in definition order.

    A module is expanded into its children when it contains (but is not) an
    instance of a block class; every other module is one block. So GPT-2 gives
    ``transformer.wte, transformer.wpe, transformer.drop, transformer.h.0, ...,
    transformer.ln_f, lm_head``.
    """
    names = set(block_classes)

    def contains_block(module: nn.Module) -> bool:
        return any(type(m).__name__ in names for m in module.modules())

    def walk(prefix: str, module: nn.Module) -> list[str]:
        if type(module).__name__ in names or not contains_block(module):
            return [prefix]
        found: list[str] = []
        for child_name, child in module.named_children():
            found += walk(f"{prefix}.{child_name}" if prefix else child_name, child)
        return found

    return walk("", model)
