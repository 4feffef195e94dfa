"""Train a model split over two devices; it matches single-device training step by step.

The split is planned with ``mode="training"`` and ``optimizer="sgd_momentum"``,
so each budget holds gradients and the momentum buffer too. The loss is
computed where the outputs land (``plan.output_device``), so the labels are
moved there; the optimizer is built on the model's own parameters,
which fxsplit moved to their devices in place. A deep copy of the model trains
on one device alongside, with the same data and the same optimizer; the script
prints both losses at every step and the largest parameter difference at the
end, and fails if they drift apart.

Runs on two GPUs when two are visible, else on two logical CPU devices.

    python examples/train_two_devices.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit

STEPS = 12
TOLERANCE = 1e-5  # logical CPU devices run the very same kernels; GPUs differ from the CPU in the last bits


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 4),
    )


def main() -> None:
    torch.manual_seed(0)
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devices = ("cuda:0", "cuda:1") if gpus else ("cpu:0", "cpu:1")
    single_device = devices[0]
    tolerance = 1e-4 if gpus else TOLERANCE

    model = make_model()
    reference = copy.deepcopy(model).to(single_device)
    data = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(STEPS)]

    # Planned for training: a budget holds weights, activations saved for backward, gradients and
    # SGD's momentum buffer. Each device gets 60% of what one device would need: the model must be split.
    alone = fxsplit.plan(
        model,
        {single_device: "1GiB"},
        example_inputs=(data[0][0],),
        trace="fx",
        mode="training",
        optimizer="sgd_momentum",
    ).memory[single_device]["total"]
    budgets = {d: int(0.6 * alone) for d in devices}
    gm = fxsplit.fxsplit(
        model, budgets, example_inputs=(data[0][0],), trace="fx", mode="training", optimizer="sgd_momentum"
    )
    plan = gm.meta["fxsplit_plan"]
    print(plan)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    gm.train()
    reference.train()
    print(f"{'step':>4}  {'split loss':>12}  {'single loss':>12}")
    for step, (x, y) in enumerate(data):
        out = gm(x)  # lands on plan.output_device
        loss = F.cross_entropy(out, y.to(plan.output_device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        ref_loss = F.cross_entropy(reference(x.to(single_device)), y.to(single_device))
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()
        print(f"{step:>4}  {loss.item():>12.6f}  {ref_loss.item():>12.6f}")
        assert abs(loss.item() - ref_loss.item()) <= tolerance * max(1.0, abs(ref_loss.item())), step

    ref_state = reference.state_dict()
    difference = max(
        (t.float().cpu() - ref_state[name].float().cpu()).abs().max().item() for name, t in model.state_dict().items()
    )
    print(f"max difference over parameters and buffers after {STEPS} steps: {difference:.3g}")
    assert difference <= tolerance, difference
    print(f"split training matches single-device training (tolerance {tolerance:g})")


if __name__ == "__main__":
    main()
