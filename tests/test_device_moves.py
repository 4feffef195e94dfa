"""Devices a split runs on are checked before any work, and a failed weight move leaves the model as it was.

Moves between logical CPU devices do not change ``tensor.device``, so the
tests that break a move part way make the first moves copy the tensor (new
storage, as a move to another device would) and fail a later one, as an
out-of-memory GPU would: after the error every tensor must be back, the same
object on its own storage, same values, same gradient.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxsplit

X = torch.randn(4, 16)
BUDGETS = {"cpu:0": "3KiB", "cpu:1": "3KiB"}  # the three Linear(16, 16) and the norm do not fit on one


def model_with_buffers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16))


Snapshot = dict[str, tuple[torch.Tensor, torch.Tensor, torch.device, int, Any]]


def snapshot(model: nn.Module) -> Snapshot:
    """Each parameter and buffer: the object, a copy of its values, its device and storage, and its gradient's."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        name: (
            t,
            t.detach().clone(),
            t.device,
            t.data_ptr(),
            None if t.grad is None else (t.grad, t.grad.clone(), t.grad.data_ptr()),
        )
        for name, t in tensors
    }


def assert_unchanged(model: nn.Module, before: Snapshot) -> None:
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert list(now) == list(before)
    for name, (tensor, values, device, storage, grad) in before.items():
        assert now[name] is tensor, name
        assert tensor.device == device and tensor.data_ptr() == storage, name
        assert torch.equal(tensor.detach(), values), name
        if grad is not None:
            assert tensor.grad is grad[0] and tensor.grad.device == device, name
            assert tensor.grad.data_ptr() == grad[2] and torch.equal(tensor.grad, grad[1]), name


def with_grads(model: nn.Module) -> nn.Module:
    model(X).sum().backward()
    return model


def failing_moves(monkeypatch: pytest.MonkeyPatch, succeed: int, kind: str = "cpu") -> list[torch.device]:
    """Make ``Tensor.to(<kind device with an index>)`` move ``succeed`` tensors, then raise out-of-memory.

    On CPU a "move" is a copy (new storage), so a tensor not put back shows.

    Only ``move_weights`` moves tensors to indexed devices during a split, so
    tracing and planning are untouched. Returns the devices asked for.
    """
    original: Callable[..., torch.Tensor] = torch.Tensor.to
    asked: list[torch.device] = []

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == kind and target.index is not None:
            asked.append(target)
            if len(asked) > succeed:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 KiB on {target}")
            return original(self, *args, **kwargs).clone()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return asked


def split_with(entry: str, model: nn.Module) -> Any:
    if entry == "fxsplit":
        return fxsplit.fxsplit(model, BUDGETS, trace="fx")
    plan = fxsplit.plan(model, BUDGETS, trace="fx")
    return fxsplit.apply(model, plan)


@pytest.mark.parametrize("entry", ["fxsplit", "apply"])
@pytest.mark.parametrize("succeed", [0, 1, 4])
def test_a_failed_move_puts_back_every_tensor(monkeypatch: pytest.MonkeyPatch, entry: str, succeed: int) -> None:
    model = with_grads(model_with_buffers())
    plan = fxsplit.plan(model, BUDGETS, trace="fx")
    assert len(set(plan.param_devices.values())) == 2  # the split really moves weights to both devices
    before = snapshot(model)
    asked = failing_moves(monkeypatch, succeed)
    with pytest.raises(fxsplit.DeviceError) as info:
        split_with(entry, model)
    monkeypatch.undo()
    assert len(asked) == succeed + 1
    message = str(info.value)
    assert "failed: OutOfMemoryError: CUDA out of memory" in message
    assert "tensor(s) moved before it were put back: the model is as it was" in message
    named = message.split("moving '")[1].split("'")[0]
    assert named in before and f"to '{asked[-1]}'" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert_unchanged(model, before)
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx")  # the model still splits and runs as before
    model.eval()
    split.eval()
    torch.testing.assert_close(split(X), model(X))


def test_a_failure_after_the_moves_puts_them_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model = with_grads(model_with_buffers())
    before = snapshot(model)
    failing_moves(monkeypatch, succeed=10**6)  # every move succeeds (a copy), so a missed rollback is visible

    def broken_emit(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(fxsplit.api, "emit", broken_emit)
    with pytest.raises(RuntimeError, match="codegen failed"):
        fxsplit.fxsplit(model, BUDGETS, trace="fx")
    monkeypatch.undo()
    assert_unchanged(model, before)


def absent_cuda() -> str:
    """A CUDA device this machine does not have (the first index past those visible)."""
    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


def refuse_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_trace(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("traced a model for a device that cannot be used")

    monkeypatch.setattr(fxsplit.api, "trace", no_trace)
    monkeypatch.setattr(importlib.import_module("fxsplit.planning.retrace"), "trace", no_trace)  # apply's re-trace


def test_an_absent_device_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_with_buffers()
    before = snapshot(model)
    budgets = {"cpu:0": "3KiB", absent_cuda(): "3KiB"}
    plan = fxsplit.plan(model, budgets, trace="fx")  # planning needs no device
    refuse_tracing(monkeypatch)
    for attempt in (lambda: fxsplit.fxsplit(model, budgets, trace="fx"), lambda: fxsplit.apply(model, plan)):
        with pytest.raises(fxsplit.DeviceError) as info:
            attempt()
        message = str(info.value)
        assert f"cannot run on '{absent_cuda()}': " in message
        assert "Devices visible here: cpu" in message
        assert "Nothing was moved" in message and "fxsplit.plan" in message
        assert "{'cpu:0': '3.00KiB', 'cpu:1': '3.00KiB'}" in message  # the same budgets on logical CPU devices
        assert isinstance(info.value, fxsplit.FxsplitError)
    assert_unchanged(model, before)


def test_an_absent_output_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_tracing(monkeypatch)
    with pytest.raises(fxsplit.DeviceError, match=f"cannot run on '{absent_cuda()}'"):
        fxsplit.fxsplit(model_with_buffers(), BUDGETS, output_device=absent_cuda())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_quickstart_devices_without_cuda_say_so() -> None:
    model = model_with_buffers()
    with pytest.raises(fxsplit.DeviceError) as info:
        fxsplit.fxsplit(model, {"cuda:0": "3KiB", "cuda:1": "3KiB"}, trace="fx")
    message = str(info.value)
    assert "'cuda:0', 'cuda:1': torch.cuda.is_available() is False" in message
    assert all(t.device.type == "cpu" for t in model.parameters())


def test_planning_for_absent_devices_still_works_on_meta_models() -> None:
    with torch.device("meta"):
        model = model_with_buffers()
    plan = fxsplit.plan(model, {"cuda:0": "3KiB", "cuda:1": "3KiB"}, example_inputs=(X.to("meta"),))
    assert set(plan.param_devices.values()) == {"cuda:0", "cuda:1"}
    plan = fxsplit.plan(model_with_buffers(), {"cuda:6": "3KiB", "xpu:3": "3KiB"}, trace="fx")
    assert plan.devices == ("cuda:6", "xpu:3")


def test_logical_cpu_devices_are_always_usable() -> None:
    from fxsplit.devices import require_usable

    require_usable(["cpu", "cpu:0", f"cpu:{127}"])


def test_every_unusable_device_is_listed_once() -> None:
    from fxsplit.devices import require_usable

    with pytest.raises(fxsplit.DeviceError) as info:
        require_usable(["cpu:0", absent_cuda(), absent_cuda(), "mps:3"])
    message = str(info.value)
    assert message.count(absent_cuda()) == 1
    assert "'mps:3': " in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("succeed", [0, 2])
def test_a_failed_move_to_a_gpu_puts_every_tensor_back_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, succeed: int
) -> None:
    model = with_grads(model_with_buffers())
    budgets = {"cpu:0": "3KiB", "cuda:0": "3KiB"}
    assert "cuda:0" in fxsplit.plan(model, budgets, trace="fx").param_devices.values()
    before = snapshot(model)
    failing_moves(monkeypatch, succeed, kind="cuda")
    with pytest.raises(fxsplit.DeviceError, match="failed: OutOfMemoryError"):
        fxsplit.fxsplit(model, budgets, trace="fx")
    monkeypatch.undo()
    assert_unchanged(model, before)
    split = fxsplit.fxsplit(model, budgets, trace="fx")
    assert {t.device.type for t in model.parameters()} == {"cpu", "cuda"}
    model.eval()
    split.eval()
    torch.testing.assert_close(split(X).cpu(), model.cpu()(X))


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_moving_a_split_off_its_devices_raises_and_a_dtype_change_works(trace: str, pipelined: bool) -> None:
    """``split.to(device)`` would take every weight off the device its plan chose while the code still copies values
    to each (Accelerate's dispatched models refuse it too); a move that changes no weight's device is allowed."""
    m = model_with_buffers().eval()
    options: dict[str, Any] = {"pipeline": fxsplit.PipelineConfig(chunks=2)} if pipelined else {}
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights", **options)
    what = "this pipeline" if pipelined else "this split"
    for move in (lambda: split.to("meta"), lambda: split.to(device="meta", dtype=torch.float64)):
        with pytest.raises(fxsplit.FxsplitError, match=rf"{what} runs across cpu:0, cpu:1 .* to meta would break"):
            move()
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in split.parameters())  # nothing moved
    assert split.to("cpu") is split and split.cpu() is split  # logical CPU devices: no weight changes device
    split.to(torch.float64)
    torch.testing.assert_close(split(X.double()), m.double()(X.double()))  # (micro-batches: rounding differs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: a split across cuda:0 and cuda:1")
def test_moving_a_split_across_two_gpus_to_one_raises() -> None:
    m = model_with_buffers().eval()
    split = fxsplit.fxsplit(m, {"cuda:0": "3KiB", "cuda:1": "3KiB"}, example_inputs=(X,), mode="weights")
    with pytest.raises(fxsplit.FxsplitError, match="runs across cuda:0, cuda:1"):
        split.to("cuda:0")
    with pytest.raises(fxsplit.FxsplitError, match="runs across cuda:0, cuda:1"):
        split.cpu()
    split.half()
    assert {p.device.index for p in split.parameters()} == {0, 1}
