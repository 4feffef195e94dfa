"""Models and a split-and-compare harness shared by the end-to-end tests."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

import fxsplit
from fxsplit.check import DeviceChecker, verify_plan, verify_split

CPUS = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def largest_leaf_bytes(model: nn.Module) -> int:
    return max((tensor_bytes(m) for m in model.modules() if not list(m.children())), default=0)


def budgets_for(model: nn.Module, devices: int) -> dict[str, int]:
    """Equal budgets that fit the model's weights over ``devices`` devices and, for these models, not on fewer.

    An even share plus the largest leaf module always fits a chain of leaves in order.
    They count parameters and buffers only: plan with them under ``mode="weights"``
    (as :func:`split_and_compare` does by default), not the default ``"inference"``,
    which also charges activations.
    """
    each = math.ceil(tensor_bytes(model) / devices) + largest_leaf_bytes(model)
    return {d: each for d in CPUS[:devices]}


def _floats(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def assert_same_structure(actual: Any, expected: Any) -> None:
    leaves_a, spec_a = tree_flatten(actual)
    leaves_e, spec_e = tree_flatten(expected)
    assert spec_a == spec_e, f"output structure differs: {spec_a} != {spec_e}"
    for a, e in zip(leaves_a, leaves_e, strict=True):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e)
        else:
            assert a == e


def default_loss(out: Any) -> torch.Tensor:
    """A loss that reaches every floating output, weighted so gradients are not all ones."""
    total = torch.zeros(())
    for i, t in enumerate(_floats(out)):
        weights = torch.linspace(0.5, 1.5, t.numel()).reshape(t.shape)
        total = total + ((t * weights).sum() * (i + 1)).to("cpu")
    return total


def split_and_compare(
    model: nn.Module,
    budgets: dict[str, int],
    inputs: Sequence[Any],
    *,
    trace: str = "fx",
    kwargs: dict[str, Any] | None = None,
    loss: Callable[[Any], torch.Tensor] = default_loss,
    steps: int = 1,
    min_devices: int = 2,
    mode: str = "weights",
    **options: Any,
) -> torch.fx.GraphModule:
    """Split a model and check it against an unsplit deep copy: outputs, gradients, buffers, invariants.

    ``mode`` defaults to ``"weights"``: budgets from :func:`budgets_for` count
    parameters and buffers only, and these checks are about placement and copies.

    Runs ``steps`` forward/backward passes on both, each forward under a
    :class:`DeviceChecker`, so an op that mixes logical devices fails.
    """
    reference = copy.deepcopy(model)
    kwargs = kwargs or {}
    params_before = {n: p for n, p in model.named_parameters()}
    gm = fxsplit.fxsplit(
        model, budgets, example_inputs=tuple(inputs), trace=trace, example_kwargs=kwargs or None, mode=mode, **options
    )
    plan = gm.meta["fxsplit_plan"]
    assert plan.trace == trace
    verify_plan(plan, model=model)
    verify_split(gm)
    used = {plan.placement[n] for n in plan.placement if n != "output"} | set(plan.param_devices.values())
    assert len(used) >= min_devices, f"expected a split over >= {min_devices} devices, got {plan}"
    assert {n: p for n, p in model.named_parameters()} == params_before  # same Parameter objects
    for step in range(steps):
        torch.manual_seed(step)  # the same random numbers (dropout) for both
        with DeviceChecker(plan, gm, model) as checker:
            out = gm(*inputs, **kwargs)
        assert checker.ops_checked > 0
        for t in _floats(out):
            assert checker.device_of(t) in (plan.output_device, None)
        torch.manual_seed(step)
        expected = reference(*inputs, **kwargs)
        assert_same_structure(out, expected)
        if any(t.requires_grad for t in _floats(expected)):
            loss(out).backward()
            loss(expected).backward()
    assert_same_grads(model, reference)
    assert_same_state(model, reference)
    return gm


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None, f"{name} has a gradient the reference has not"
        else:
            assert p.grad is not None, f"{name} has no gradient"
            torch.testing.assert_close(p.grad, ref[name].grad, msg=lambda m, n=name: f"grad of {n}: {m}")


def assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    ref = reference.state_dict()
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, ref[name], msg=lambda m, n=name: f"state {n}: {m}")


# --------------------------------------------------------------------------- models


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)
    )


class Residual(nn.Module):
    def __init__(self, width: int = 24, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(self.norm(h))


class UNet(nn.Module):
    """Two levels down, two up, with long skips concatenated across the whole net."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.enc1 = nn.Conv2d(3, c, 3, padding=1)
        self.enc2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.dec2 = nn.Conv2d(4 * c, c, 3, padding=1)
        self.dec1 = nn.Conv2d(2 * c, c, 3, padding=1)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = F.relu(self.enc1(x))
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))
        m = F.relu(self.mid(F.max_pool2d(e2, 2)))
        d2 = F.relu(self.dec2(torch.cat([F.interpolate(m, scale_factor=2.0), e2], dim=1)))
        d1 = F.relu(self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1)))
        return self.head(d1)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.b = nn.Sequential(nn.Linear(16, 16), nn.Sigmoid())
        self.c = nn.Linear(16, 16)
        self.merge = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        a, b, c = self.a(h), self.b(h), self.c(h)
        return self.merge(torch.cat([a + b * c, a * c, b - h], dim=-1))


class Tied(nn.Module):
    """A language-model shape: the output head shares the embedding's weight."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


class WithBatchNorm(nn.Module):
    """Two batch norms; ``cumulative`` makes the second average over all batches (momentum=None).

    torch.export cannot trace the cumulative average (it reads a buffer as a Python float).
    """

    def __init__(self, cumulative: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.l2 = nn.Linear(16, 16)
        self.bn2 = nn.BatchNorm1d(16, momentum=None if cumulative else 0.3)
        self.l3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(F.relu(self.bn2(self.l2(F.relu(self.bn1(self.l1(x)))))))


class MultiIO(nn.Module):
    """Two inputs; a tuple of outputs holding a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.fx = nn.Linear(6, 12)
        self.fy = nn.Linear(4, 12)
        self.mix = nn.Linear(12, 12)
        self.h1 = nn.Linear(12, 3)
        self.h2 = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.mix(torch.tanh(self.fx(x)) + self.fy(y))
        return self.h1(h), {"logits": self.h2(h), "y_echo": y * 2, "hidden": h}


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.b(torch.relu(self.a(x)))
        return {"out": self.d(self.c(h)) * scale, "mid": h}


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.l4 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.l1(x))  # relu_ on a fresh activation
        g = self.l2(h)
        g.mul_(0.5)
        g += h  # in place on one stage's value, reading a value that may come from another
        g.relu_()
        k = self.l3(g) * 1.0
        k.add_(h)
        return self.l4(k)


class HardCodedDevices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        positions = torch.arange(h.shape[-1], device=h.device, dtype=h.dtype)
        h = self.l2(h + positions)
        h = h.to("cpu") * torch.ones(h.shape[-1], device="cpu")
        return self.l3(h) + torch.zeros_like(h)


class SharedModule(nn.Module):
    """One Linear called first and last: its weights are needed on two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.c(self.b(self.a(x))))


class DirectParameter(nn.Module):
    """A bare Parameter used by two ops far apart (a get_attr read twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(x @ self.w)) @ self.w.t()


class Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(self.b(self.drop(self.a(x)))))


class Passthrough(nn.Module):
    """Returns an input, one tensor twice, a size and None."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        h = self.b(self.a(x))
        return h, x, h, x.shape[0], None


class SizeLater(nn.Module):
    """A size read at the start and used at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return self.c(self.b(self.a(x))).view(n, 2, 4).sum(1) * n


class Unused(nn.Module):
    """A module never called, a None buffer and a buffer no op reads: all still get a device."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("nothing", None)
        self.register_buffer("idle", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class RunningSum(nn.Module):
    """A buffer updated in place by forward, then read at the end (not a BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.total.add_(h.detach().mean(0))
        return self.c(self.b(h)) + self.total


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages ATen ops make while it is on and that are still alive (not ``resident``)."""

    def __init__(self, resident: list[torch.Tensor]) -> None:
        super().__init__()
        self.resident = {StorageWeakRef(t.untyped_storage()) for t in resident}
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [k for k in self.live if k.expired()]:
            del self.live[key]
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                key = StorageWeakRef(tensor.untyped_storage())
                if key not in self.resident and key not in self.live:
                    self.live[key] = tensor.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def saved_then_empty(directory: Any, config: Any, saved: Any, loaded: Any) -> tuple[nn.Module, nn.Module]:
    """A transformers ``saved(config)`` with seeded weights written to ``directory`` by ``save_pretrained``; returns
    ``loaded.from_pretrained(directory)`` (the reference) and a ``loaded(config)`` built without weights."""
    torch.manual_seed(0)
    saved(config).save_pretrained(directory)
    reference = loaded.from_pretrained(directory).eval()
    with fxsplit.empty_weights():
        model = loaded(config).eval()
    return reference, model
