"""Small random graphs whose every intermediate value is reduced with ``sum`` and ``mean`` into the output.

Linear layers, activations (some in place), adds (some in place), multiplies written in place and concatenations
over a random choice of earlier values: the shapes of gradient that a loss reading every value makes (broadcasts
from ``sum``, dense ones from ``mean``, one tensor handed to several values by the adds). Built from a seed, as the
memory tests' random graphs were (the same seed gives the same model and input).
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SinkGraph", "sink_graph"]


class SinkGraph(nn.Module):
    """A random graph of 4-9 ops of width ``width`` over one input, then every value reduced into the head."""

    def __init__(self, rng: random.Random, width: int) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.lins = nn.ModuleList()
        values = 1
        for _ in range(rng.randint(4, 10)):
            kind = rng.choice(["lin", "lin", "act", "act_", "add", "add_", "cat", "mul_", "lin_ip"])
            a, b = rng.randrange(values), rng.randrange(values)
            if kind in ("lin", "lin_ip"):
                self.lins.append(nn.Linear(width, width))
                self.ops.append((kind, a, len(self.lins) - 1, rng.choice(["relu", "gelu", "tanh", "sigmoid"])))
            elif kind == "cat":
                self.lins.append(nn.Linear(2 * width, width))
                self.ops.append((kind, a, b, len(self.lins) - 1))
            elif kind in ("act", "act_"):
                self.ops.append((kind, a, rng.choice(["relu", "sigmoid", "tanh", "silu"])))
            else:
                self.ops.append((kind, a, b))
            values += 1
        self.outputs = rng.randint(1, 2)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        v = [x]
        for op in self.ops:
            kind = op[0]
            if kind == "lin":
                v.append(self.lins[op[2]](v[op[1]]))
            elif kind == "lin_ip":
                h, act = self.lins[op[2]](v[op[1]]), op[3]
                v.append(F.gelu(h) if act == "gelu" else getattr(h, act + "_")())
            elif kind == "act":
                v.append(F.silu(v[op[1]]) if op[2] == "silu" else getattr(torch, op[2])(v[op[1]]))
            elif kind == "act_":
                h = v[op[1]] * 1.0
                v.append(F.silu(h, inplace=True) if op[2] == "silu" else getattr(h, op[2] + "_")())
            elif kind == "add":
                v.append(v[op[1]] + v[op[2]])
            elif kind == "add_":
                v.append((v[op[1]] + 1.0).add_(v[op[2]]))
            elif kind == "mul_":
                v.append((v[op[1]] * 0.5).mul_(v[op[2]]))
            else:
                v.append(self.lins[op[3]](torch.cat([v[op[1]], v[op[2]]], -1)))
        acc = v[-1]
        for value in v[1:-1]:
            acc = acc + value.sum() * 0.0 + value.mean()
        out = self.head(acc)
        if self.outputs == 2:
            return out, v[len(v) // 2] if len(v) > 2 else v[-1] * 2
        return out


def sink_graph(seed: int) -> tuple[SinkGraph, torch.Tensor, str]:
    """The model, its input and the trace (``"fx"`` or ``"export"``) of ``seed``."""
    rng = random.Random(seed)
    width, batch, how = rng.choice([32, 64, 96]), rng.choice([1, 3, 16, 40]), rng.choice(["fx", "export"])
    torch.manual_seed(seed)
    return SinkGraph(rng, width), torch.randn(batch, width), how
