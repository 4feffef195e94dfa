"""The words of memory errors: each component of a device's memory row named, listed, summed and advised on."""

from __future__ import annotations

from typing import Mapping

from fxsplit.units import format_size

__all__ = ["COMPONENTS", "KEPT", "ROW", "TRANSIENT", "WORDS", "advice", "first_over", "listing", "summed"]

COMPONENTS = ("params", "buffers", "grads", "optimizer", "activations_peak", "optimizer_step")  # model-wide
WORDS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations_peak": "activations peak",
    "stage_copies": "stages' own weight copies",
    "optimizer_step": "optimizer step (temporaries, outputs held)",
}
KEPT = ("params", "buffers", "grads", "optimizer", "stage_copies")  # alive through the whole step, in row order
TRANSIENT = ("activations_peak", "optimizer_step")  # not alive at once: a total counts the larger
ROW = KEPT + TRANSIENT  # a plan's row, in order


def first_over(component: str, nbytes: int) -> str:
    """'the parameters alone exceed them' / 'adding the gradients (1.00 GiB) exceeds them'."""
    if component == "params":
        return "the parameters alone exceed them"
    return f"adding the {WORDS[component]} ({format_size(nbytes)}) exceeds them"


def listing(row: Mapping[str, int]) -> str:
    """'parameters 1.00 MiB, gradients 1.00 MiB': each component of ``row`` that holds bytes, in row order (the
    larger of the activations and the optimizer step, when both do: they are not alive at once)."""
    parts = [f"{WORDS[name]} {format_size(row[name])}" for name in KEPT if row.get(name)]
    transient = [f"{WORDS[name]} {format_size(row[name])}" for name in TRANSIENT if row.get(name)]
    parts += [f"the larger of {transient[0]} and {transient[1]}"] if len(transient) == 2 else transient
    return ", ".join(parts)


def summed(row: Mapping[str, int]) -> str:
    """'parameters 1.00 MiB, activations peak 2.00 KiB = 1.00 MiB', without '= total' for one component."""
    parts = [name for name in COMPONENTS if row.get(name)]
    kept = sum(row[name] for name in parts if name not in TRANSIENT)
    total = kept + max((row.get(name, 0) for name in TRANSIENT), default=0)  # (never both at once: the larger)
    total_text = f" = {format_size(total)}" if len(parts) > 1 else ""
    return listing(row) + total_text


def advice(component: str, optimizer: str = "adamw") -> str:
    """What to do when ``component`` is what does not fit; ``optimizer``: the name of the optimizer planned for,
    which a fused step's setting names."""
    if component in ("params", "buffers"):
        return "raise the budgets or add a device"
    if component in ("grads", "optimizer"):
        return (
            "raise the budgets, add a device, freeze parameters (requires_grad=False) or pick an optimizer "
            "with less state (optimizer='sgd')"
        )
    if component == "optimizer_step":  # smaller inputs shrink only the outputs it counts, not the temporaries
        return (
            "raise the budgets, add a device, freeze parameters (requires_grad=False) or step with a fused "
            f"optimizer, which holds no temporaries (optimizer={{'name': {optimizer!r}, 'fused': True}})"
        )
    return "raise the budgets, add a device, or plan with smaller example inputs (batch, sequence length)"
