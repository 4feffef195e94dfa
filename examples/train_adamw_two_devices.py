"""Train a model split over two devices with AdamW; it matches training on one device, step by step.

The split is planned with ``mode="training"``: each device's budget holds its
parameters, their gradients, AdamW's two state tensors per parameter and
the activations saved for backward, at their peak. The labels go where the
outputs land (``plan.output_device``), so the loss is computed there.

    python examples/train_adamw_two_devices.py            # cpu:0 / cpu:1 (or cuda:0 / cuda:1 with 2 GPUs)

What it prints: the plan (with its memory table), then the loss of every
step for the split and the single-device model, and the largest difference
in parameters after the last step. On logical CPU devices the two run the
same kernels in the same order, so they agree exactly; on GPUs they agree
within float32 tolerance (``torch.testing.assert_close``: rtol 1.3e-6,
atol 1e-5).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxsplit


class Classifier(nn.Module):
    """Embedding, residual MLP blocks with layer norm, a classification head."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))


def devices() -> tuple[str, str]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return "cuda:0", "cuda:1"
    return "cpu:0", "cpu:1"


def batches(steps: int, batch: int = 16, length: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (batch, length), generator=gen), torch.randint(0, 5, (batch,), generator=gen))
        for _ in range(steps)
    ]


def train(steps: int = 5, *, verbose: bool = True) -> dict[str, object]:
    """Train the split and the unsplit model side by side; return losses and final parameters of both."""
    torch.manual_seed(0)
    model = Classifier()
    first, second = devices()
    reference = copy.deepcopy(model).to(first)
    data = batches(steps)

    # Budgets: each device gets 70% of what training the whole model on one device needs.
    alone = fxsplit.plan(
        model, {first: "1GiB"}, example_inputs=(data[0][0],), mode="training", optimizer="adamw"
    ).memory[first]
    each = int(0.7 * alone["total"])
    split = fxsplit.fxsplit(
        model, {first: each, second: each}, example_inputs=(data[0][0],), mode="training", optimizer="adamw"
    )
    plan = split.meta["fxsplit_plan"]
    if verbose:
        print(plan, end="\n\n")

    optimizer = torch.optim.AdamW(split.parameters(), lr=1e-2)  # the same Parameters as model's, moved in place
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses: list[float] = []
    reference_losses: list[float] = []
    for step, (tokens, labels) in enumerate(data):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(split(tokens), labels.to(plan.output_device))
        loss.backward()
        optimizer.step()

        reference_optimizer.zero_grad()
        reference_loss = nn.functional.cross_entropy(reference(tokens.to(first)), labels.to(first))
        reference_loss.backward()
        reference_optimizer.step()

        losses.append(loss.item())
        reference_losses.append(reference_loss.item())
        if verbose:
            print(f"step {step}: split loss {losses[-1]:.6f}   one-device loss {reference_losses[-1]:.6f}")

    params = {name: p.detach().to("cpu") for name, p in model.named_parameters()}
    reference_params = {name: p.detach().to("cpu") for name, p in reference.named_parameters()}
    if verbose:
        worst = max((params[n] - reference_params[n]).abs().max().item() for n in params)
        print(f"largest parameter difference after {steps} steps: {worst:.3g}")
    return {
        "plan": plan,
        "losses": losses,
        "reference_losses": reference_losses,
        "params": params,
        "reference_params": reference_params,
    }


if __name__ == "__main__":
    train()
