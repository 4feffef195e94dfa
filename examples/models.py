"""Example models for the ``fxsplit`` command line: ``fxsplit plan examples/models.py:factory --spec ...``.

A factory takes no arguments and returns the model, or ``(model, example_inputs)``.

``TinyLM`` is a small decoder-style language model named like Hugging Face's
Llama (``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``),
with the output head tied to the token embedding, so that specs written for
real models work on it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block (attention left out to keep the example small)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Body(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLM(nn.Module):
    """Token ids -> logits; ``lm_head.weight`` is ``model.embed_tokens.weight`` (tied)."""

    def __init__(self, vocab: int = 512, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.model = Body(vocab, width, depth)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """TinyLM (about 1.2 MiB of float32 weights) and a batch of token ids."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    ids = torch.randint(0, 512, (2, 16))
    return model, (ids,)


def untied() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The same model with its own output head: a different structure (for `fxsplit check` demos)."""
    model, inputs = factory()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model, inputs


def mlp() -> nn.Module:
    """A three-layer MLP without example inputs (traced with torch.fx, no shapes)."""
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
