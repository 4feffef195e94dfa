"""Tiny models for the pipelining tests (in-process and torchrun workers import them)."""

from __future__ import annotations

import torch
from torch import nn


def budgets(model: nn.Module, devices: int, slack: float = 1.25, replicas: bool = False) -> dict[str, int]:
    """Per-device budgets tight enough that ``devices`` devices are all needed.

    ``replicas``: each device also has room for a copy of every tied weight (``pipeline_stages`` gives each
    stage that reads one its own copy, which the budgets must hold).
    """
    total = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = {id(p): p.numel() * p.element_size() for p in model.parameters() if len(names[id(p)]) > 1}
    room = sum(tied.values()) if replicas else 0
    return {f"cpu:{i}": int(total / devices * slack) + room for i in range(devices)}


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Residual(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class LongSkip(nn.Module):
    """``first``'s output is read again by the last layer: a value that crosses two stages."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.middle = nn.Sequential(*[m for _ in range(4) for m in (nn.Tanh(), nn.Linear(width, width))])
        self.last = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.last(self.middle(h)) * h


class Transposed(nn.Module):
    """Cut at a slice of a transpose (``pins``): strided, where the ranks exchange contiguous tensors only."""

    pins = {"a": "cpu:0", "b": "cpu:1"}

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).transpose(1, 2)[..., :2])  # (batch, 16, 2), strided


class TwoHeads(nn.Module):
    """Two inputs, a dict output holding a tuple; one output is made on the first stage."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
        h = torch.tanh(self.a(x)) + y
        g = torch.tanh(self.c(torch.tanh(self.b(h))))
        return {"logits": self.d(g), "extra": (h.sum(-1), g)}


class Tied(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 24, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


class WithBatchNorm(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))
