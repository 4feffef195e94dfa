"""Sizes and device names: what users write becomes bytes and canonical device strings."""

from __future__ import annotations

import pytest
import torch

from fxsplit.devices import normalize_budgets, normalize_device, require_usable, visible_devices
from fxsplit.errors import DeviceError, SpecError
from fxsplit.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("1.5 gib", 3 * 2**29),
        (" 10 kB ", 10_000),
        ("10KiB", 10_240),
        ("3k", 3 * 1024),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("100", 100),
        ("100B", 100),
        ("1e3", 1000),
        (".5KiB", 512),
        (4096, 4096),
        (0, 0),
        (2048.0, 2048),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10 GiBs", "unknown unit 'GiBs'; use one of B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"),
        ("lots", "is not a size"),
        ("-1GiB", "must not be negative (got '-1GiB')"),
        ("--1GiB", "is not a size"),
        (-5, "must not be negative (got -5)"),
        (-0.5, "finite, non-negative"),
        (float("inf"), "finite, non-negative"),
        (True, "must be a byte count"),
        (None, "must be a byte count or a string like '20GiB' (got NoneType)"),
    ],
)
def test_parse_size_rejects(value: object, message: str) -> None:
    with pytest.raises(SpecError, match="budget of 'cuda:0'") as info:
        parse_size(value, what="budget of 'cuda:0'")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * 2**30, "3.00 GiB"),
        (5 * 2**40, "5.00 TiB"),
        (-2048, "-2.00 KiB"),
        (None, "unknown"),
    ],
)
def test_format_size(nbytes: int | None, text: str) -> None:
    assert format_size(nbytes) == text


def test_parse_format_round_trip() -> None:
    for n in (1, 1024, 5 * 2**20, 7 * 2**30):
        assert parse_size(format_size(n).replace(" ", "")) == n


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (0, "cuda:0"),
        (3, "cuda:3"),
        ("cuda:1", "cuda:1"),
        ("cpu", "cpu"),
        ("cpu:3", "cpu:3"),
        (" cpu:2 ", "cpu:2"),
        (torch.device("cpu", 1), "cpu:1"),
        (torch.device("cuda", 2), "cuda:2"),
        ("cuda", "cuda"),
    ],
)
def test_normalize_device(key: object, name: str) -> None:
    assert normalize_device(key) == name


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("tpu9", "'tpu9' is not a device; write 'cuda:0', 'cpu', 'cpu:1', or an int for a CUDA index"),
        (-1, "must not be negative (got -1)"),
        (True, "must be a string, torch.device or int (got True)"),
        (1.5, "(got float)"),
        ("meta", "'meta' holds no data"),
        (torch.device("meta"), "'meta' holds no data"),
    ],
)
def test_normalize_device_rejects(key: object, message: str) -> None:
    with pytest.raises(SpecError) as info:
        normalize_device(key)
    assert message in str(info.value)


def test_normalize_budgets_keeps_order_and_units() -> None:
    budgets = normalize_budgets({"cuda:1": "1GiB", 0: 2**30, torch.device("cpu", 2): "1kB", "cpu": 7})
    assert list(budgets.items()) == [("cuda:1", 2**30), ("cuda:0", 2**30), ("cpu:2", 1000), ("cpu", 7)]


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({0: "1GiB", "cuda:0": "2GiB"}, "budgets name device 'cuda:0' twice"),
        ({"cpu:1": 1, torch.device("cpu", 1): 2}, "budgets name device 'cpu:1' twice"),
        ({}, "at least one device"),
        ([("cpu:0", 1)], "must be a mapping of device to bytes"),
        ({"cpu:0": "10 GiBs"}, "budget of 'cpu:0' '10 GiBs' has unknown unit 'GiBs'"),
        ({"cpu:0": -1}, "budget of 'cpu:0' must not be negative"),
        ({"gpu:0": 1}, "'gpu:0' is not a device"),
    ],
)
def test_normalize_budgets_rejects(budgets: object, message: str) -> None:
    with pytest.raises(SpecError) as info:
        normalize_budgets(budgets)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA as torch would report two visible devices (no other accelerator)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)


def test_visible_devices_are_the_cpu_then_each_gpu(two_gpus: None) -> None:
    assert visible_devices() == ["cpu", "cuda:0", "cuda:1"]


def test_require_usable_accepts_visible_and_logical_devices(two_gpus: None) -> None:
    require_usable(["cpu", "cpu:5", "cuda", "cuda:0", "cuda:1"])  # raises when one is not


def test_require_usable_names_each_device_beyond_those_visible(two_gpus: None) -> None:
    with pytest.raises(DeviceError) as info:
        require_usable(["cuda:0", "cuda:2", "cuda:3", "cuda:2"], {"cuda:0": 2**30, "cuda:2": 3 * 2**20})
    message = str(info.value)
    assert message.startswith(
        "cannot run on 'cuda:2', 'cuda:3': only 2 cuda device(s) are visible (cuda:0 to cuda:1). "
        "Devices visible here: cpu, cuda:0, cuda:1. Nothing was moved."
    )
    assert message.endswith("logical CPU devices, which all run on the CPU: {'cpu:0': '1.00GiB', 'cpu:1': '3.00MiB'}")
    assert isinstance(info.value, RuntimeError)


def test_require_usable_without_cuda_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"'cuda:0': torch.cuda.is_available\(\) is False \(") as info:
        require_usable(["cpu:0", "cuda:0"])
    assert "{'cpu:0': '20GiB', 'cpu:1': '20GiB'}" in str(info.value)  # no budgets given: an example
    assert not any(device.startswith("cuda") for device in visible_devices())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gpu:1", "did you mean 'cuda:1'?"),
        ("cuda:-1", "the index after 'cuda:' must be a whole number >= 0"),
        ("cpu:x", "the index after 'cpu:' must be a whole number >= 0"),
    ],
)
def test_spec_devices_say_what_is_wrong_with_a_name(value: str, message: str) -> None:
    from fxsplit.spec.fields import spec_device

    with pytest.raises(SpecError) as info:
        spec_device(value)
    assert message in str(info.value) and "did you mean 'cuda:-1'" not in str(info.value)
