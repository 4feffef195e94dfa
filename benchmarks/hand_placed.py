"""The placements fxsplit chose, written by hand in eager PyTorch, as a person would.

Each class takes the original model and an fxsplit :class:`~fxsplit.Plan`,
puts every block on the device the plan gave its parameters (``module.to``,
skipped with ``move=False`` when the weights are already there), and moves the
activation with ``.to(device)`` where the next block lives elsewhere: the
classic manual model-parallel forward. Nothing is traced or hooked. Both are
checked against the unsplit model by the runtime benchmark.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.planning.plan import Plan

__all__ = ["HandGPT2", "HandMLP", "hand_placed"]


def _stages(blocks: list[nn.Module], devices: list[str], move: bool) -> tuple[nn.ModuleList, list[str]]:
    stages: list[nn.Sequential] = []
    stage_devices: list[str] = []
    for block, device in zip(blocks, devices, strict=True):
        if not stage_devices or stage_devices[-1] != device:
            stages.append(nn.Sequential())
            stage_devices.append(device)
        stages[-1].append(block.to(device) if move else block)
    return nn.ModuleList(stages), stage_devices


class HandMLP(nn.Module):
    """``x = stage_k(x.to("cpu:k"))`` for each run of consecutive blocks on one device."""

    def __init__(self, model: nn.Module, plan: Plan, move: bool = True) -> None:
        super().__init__()
        blocks = list(model.blocks)  # type: ignore[arg-type]
        devices = [plan.param_devices[f"blocks.{i}.fc.weight"] for i in range(len(blocks))]
        self.stages, self.devices = _stages(blocks, devices, move)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(device))
        return x


class _GPT2Stage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)  # no mask: scaled-dot-product attention is causal by itself
        return hidden


class HandGPT2(nn.Module):
    """GPT-2 (LM head, no cache, no padding mask) with its blocks on the plan's devices."""

    def __init__(self, model: Any, plan: Plan, move: bool = True) -> None:
        super().__init__()
        t: Any = model.transformer
        dev = plan.param_devices
        self.wte: Any = t.wte
        self.wpe: Any = t.wpe
        self.drop: Any = t.drop
        self.ln_f: Any = t.ln_f
        self.embed_device = dev["transformer.wte.weight"]
        blocks = list(t.h)
        devices = [dev[f"transformer.h.{i}.ln_1.weight"] for i in range(len(blocks))]
        groups: list[list[nn.Module]] = []
        self.devices: list[str] = []
        for block, device in zip(blocks, devices, strict=True):
            if not self.devices or self.devices[-1] != device:
                groups.append([])
                self.devices.append(device)
            groups[-1].append(block.to(device) if move else block)
        self.stages = nn.ModuleList(_GPT2Stage(g) for g in groups)
        self.head_device = dev["transformer.ln_f.weight"]
        if move:
            self.wte.to(self.embed_device)
            self.wpe.to(self.embed_device)
            self.ln_f.to(self.head_device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.to(self.embed_device)
        positions = torch.arange(input_ids.shape[1], device=self.embed_device)
        hidden = self.drop(self.wte(input_ids) + self.wpe(positions)[None])
        for stage, device in zip(self.stages, self.devices, strict=True):
            hidden = stage(hidden.to(device))
        hidden = self.ln_f(hidden.to(self.head_device))
        weight = self.wte.weight  # tied with lm_head: copied to the head's device when it lives elsewhere
        if self.head_device != self.embed_device:
            weight = weight.to(self.head_device)
        return F.linear(hidden, weight)


def hand_placed(name: str, model: nn.Module, plan: Plan, move: bool = True) -> Any:
    """The hand-written version of ``plan`` for the benchmark model called ``name``."""
    if name == "mlp48":
        return HandMLP(model, plan, move)
    if name == "gpt2":
        return HandGPT2(model, plan, move)
    raise ValueError(f"no hand-written placement for {name!r}; write one in benchmarks/hand_placed.py")
