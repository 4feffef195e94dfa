"""fxsplit.options: Budgets (read and checked once), Options (every option documented), the option choices and
the pipeline option's value: plain data, validated when made."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

import fxsplit
from fxsplit.options import (
    BATCH_STATS_MODES,
    CHECKPOINT_MODES,
    MODES,
    OBJECTIVES,
    TRACE_MODES,
    Budgets,
    Options,
    PipelineConfig,
    usable_bytes,
)
from fxsplit.planning.plan import Plan
from fxsplit.spec import load_spec

# -- Budgets ---------------------------------------------------------------------------------------


def test_budgets_keep_the_stage_order_and_derive_what_is_usable() -> None:
    budgets = Budgets({"cpu:1": 1000, "cpu:0": 500, "cpu:2": 0}, reserved={"cpu:1": 100})
    assert budgets.devices == ("cpu:1", "cpu:0", "cpu:2")
    assert budgets.limits == {"cpu:1": 1000, "cpu:0": 500, "cpu:2": 0}
    assert budgets.usable == {"cpu:1": 900, "cpu:0": 500, "cpu:2": 0}
    assert budgets.caps() == [900, 500, 0]
    assert Budgets({"cpu:0": 7}).reserved == {}


def test_usable_bytes_are_never_negative() -> None:
    assert usable_bytes(100, 30) == 70
    assert usable_bytes(100, 130) == 0


def test_budgets_are_a_frozen_copy() -> None:
    written = {"cpu:0": 100}
    budgets = Budgets(written)
    written["cpu:0"] = 1
    assert budgets.limits == {"cpu:0": 100}
    with pytest.raises(dataclasses.FrozenInstanceError):
        budgets.limits = {}  # type: ignore[misc]


def test_parse_reads_sizes_devices_and_reserves_once() -> None:
    budgets = Budgets.parse({"cpu:1": "1KiB", torch.device("cpu", 0): 2048, 3: "1kB"}, reserve="10%")
    assert budgets.devices == ("cpu:1", "cpu:0", "cuda:3")
    assert budgets.limits == {"cpu:1": 1024, "cpu:0": 2048, "cuda:3": 1000}
    assert budgets.reserved == {"cpu:1": 102, "cpu:0": 204, "cuda:3": 100}
    assert budgets.usable == {"cpu:1": 922, "cpu:0": 1844, "cuda:3": 900}
    per_device = Budgets.parse({"cpu:0": 1000, "cpu:1": 0}, reserve={"cpu:0": "100B", "cpu:1": "10%"})
    assert per_device.reserved == {"cpu:0": 100, "cpu:1": 0}  # a budget of 0 holds nothing back
    assert Budgets.parse({"cpu:0": 1000}).reserved == {}


def test_parse_reads_auto_as_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxsplit.memory.autobudget

    monkeypatch.setattr(fxsplit.memory.autobudget, "auto_budgets", lambda: {"cuda:0": 4096, "cuda:1": 2048})
    assert Budgets.parse("auto", reserve=1024).usable == {"cuda:0": 3072, "cuda:1": 1024}


@pytest.mark.parametrize(
    ("written", "reserve", "message"),
    [
        ({}, None, "budgets must name at least one device"),
        (["cpu:0"], None, "budgets must be a mapping of device to bytes"),
        ("lots", None, "budgets must be a mapping of device to bytes"),
        ({"cpu:0": -1}, None, "must not be negative"),
        ({"cpu:0": "10XB"}, None, "unknown unit 'XB'"),
        ({"cpu:0": 1, 0: 1, "cuda:0": 1}, None, "name device 'cuda:0' twice"),
        ({"cpu:0": 1000}, {"cpu:1": 10}, "reserve names 'cpu:1', which has no budget"),
        ({"cpu:0": 1000}, "1000B", r"reserve 1000 B of 'cpu:0' leaves nothing of its budget 1000 B"),
        ({"cpu:0": 1000}, "100%", "not a percentage"),
    ],
)
def test_parse_refuses_with_one_clear_spec_error(written: object, reserve: object, message: str) -> None:
    with pytest.raises(fxsplit.SpecError, match=message):
        Budgets.parse(written, reserve)


@pytest.mark.parametrize(
    ("limits", "reserved", "message"),
    [
        ({}, {}, r"budgets must name at least one device"),
        ({0: 10}, {}, r"budget devices must be device names like 'cuda:0' \(got 0\)"),
        ({"cpu:0": -1}, {}, r"budget of 'cpu:0' must be an int >= 0 bytes \(got -1\)"),
        ({"cpu:0": True}, {}, r"budget of 'cpu:0' must be an int >= 0 bytes \(got True\)"),
        ({"cpu:0": "1KiB"}, {}, r"budget of 'cpu:0' must be an int >= 0 bytes \(got '1KiB'\)"),
        ({"cpu:0": 10}, {"cpu:0": -1}, r"reserve of 'cpu:0' must be an int >= 0 bytes"),
        ({"cpu:0": 10}, {"cpu:1": 1}, r"reserve names 'cpu:1', which has no budget \(devices: cpu:0\)"),
        ({"cpu:0": 10}, {"cpu:0": 10}, r"reserve 10 B of 'cpu:0' leaves nothing of its budget 10 B; reserve less"),
        ({"cpu:0": 0}, {"cpu:0": 1}, r"reserve 1 B of 'cpu:0' leaves nothing of its budget 0 B"),
    ],
)
def test_budgets_check_what_they_are_given(limits: dict[str, int], reserved: dict[str, int], message: str) -> None:
    with pytest.raises(fxsplit.SpecError, match=message):
        Budgets(limits, reserved)


def test_a_plan_records_the_full_budgets_and_plans_under_the_usable_ones() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    plan = fxsplit.plan(model, {"cpu:0": "2KiB", "cpu:1": "2KiB"}, mode="weights", trace="fx", reserve="900B")
    assert plan.budgets == {"cpu:0": 2048, "cpu:1": 2048} and plan.reserved == {"cpu:0": 900, "cpu:1": 900}
    assert plan.usable == {"cpu:0": 1148, "cpu:1": 1148}  # one 1088-byte layer each; 2 KiB would take both
    assert plan.param_devices["0.weight"] == "cpu:0" and plan.param_devices["2.weight"] == "cpu:1"
    assert all(plan.memory[d]["total"] <= plan.usable[d] for d in plan.devices)
    assert Plan.from_yaml(plan.to_yaml()).usable == plan.usable


# -- Options ---------------------------------------------------------------------------------------


def _documented(cls: type) -> dict[str, str]:
    """Attribute name -> its text, from the ``Attributes:`` section of ``cls``'s docstring."""
    section = (cls.__doc__ or "").split("Attributes:", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n {8}(?=\w+: )", section)
    return {entry.split(":", 1)[0].strip(): entry.split(":", 1)[1] for entry in entries if ":" in entry}


def test_every_option_is_documented() -> None:
    fields = [f.name for f in dataclasses.fields(Options)]
    assert list(_documented(Options)) == fields
    assert all(text.strip() for text in _documented(Options).values())


def test_option_defaults_are_the_documented_choices() -> None:
    options = Options()
    assert options.trace == TRACE_MODES[0] == "auto"
    assert options.objective is None and options.chosen_objective == OBJECTIVES[0] == "min_transfer"
    assert Options(pipeline=PipelineConfig(2)).chosen_objective == "throughput"
    assert options.mode == MODES[0] == "inference"
    assert (options.check, options.contiguous, options.pipeline, options.reserve) == (False, False, None, None)


def test_options_are_what_plan_takes() -> None:
    from fxsplit.optionparse import OPTION_NAMES

    assert OPTION_NAMES == tuple(f.name for f in dataclasses.fields(Options))
    with pytest.raises(fxsplit.SpecError, match="unknown option 'objectiv'; did you mean 'objective'"):
        fxsplit.plan(torch.nn.Linear(2, 2), {"cpu:0": "1KiB"}, objectiv="balanced")


def test_every_budgets_field_is_documented() -> None:
    assert list(_documented(Budgets)) == [f.name for f in dataclasses.fields(Budgets)]


# -- PipelineConfig and the option choices ------------------------------------------------------


def test_defaults() -> None:
    config = PipelineConfig(chunks=4)
    assert (config.chunks, config.checkpoint, config.batch_stats, config.broadcast) == (4, "never", "warn", ())
    assert config.checkpoint in CHECKPOINT_MODES and config.batch_stats in BATCH_STATS_MODES


@pytest.mark.parametrize(("given", "stored"), [(True, "always"), (False, "never"), *((m, m) for m in CHECKPOINT_MODES)])
def test_checkpoint_is_stored_as_a_mode_name(given: Any, stored: str) -> None:
    assert PipelineConfig(chunks=2, checkpoint=given).checkpoint == stored


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"chunks": 0}, "pipeline chunks must be an int >= 1 (got 0)"),
        ({"chunks": True}, "pipeline chunks must be an int >= 1 (got True)"),
        ({"chunks": 2.0}, "pipeline chunks must be an int >= 1 (got 2.0)"),
        ({"chunks": 2, "checkpoint": "sometimes"}, "must be True, False or one of never, except_last, always"),
        ({"chunks": 2, "checkpoint": 1}, "(got 1)"),
        ({"chunks": 2, "batch_stats": "ignore"}, "batch_stats must be one of warn, error, allow (got 'ignore')"),
        ({"chunks": 2, "broadcast": "mask"}, "broadcast must be a tuple of input names (got the string 'mask')"),
    ],
)
def test_bad_values_are_refused_when_made(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        PipelineConfig(**fields)
    assert message in str(info.value)


def test_broadcast_becomes_a_tuple_and_the_config_is_frozen_and_hashable() -> None:
    config = PipelineConfig(chunks=2, broadcast=["mask"])  # type: ignore[arg-type]
    assert config.broadcast == ("mask",)
    assert hash(config) == hash(PipelineConfig(chunks=2, broadcast=("mask",)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.chunks = 3  # type: ignore[misc]


def test_coerce() -> None:
    config = PipelineConfig(chunks=3, checkpoint=True)
    assert PipelineConfig.coerce(config) is config
    assert PipelineConfig.coerce(3) == PipelineConfig(chunks=3)
    assert PipelineConfig.coerce({"chunks": 2, "batch_stats": "allow"}) == PipelineConfig(chunks=2, batch_stats="allow")
    with pytest.raises(fxsplit.SpecError, match="unknown pipeline option\\(s\\) 'chunk', 'extra'; options are chunks"):
        PipelineConfig.coerce({"chunk": 2, "extra": 1})
    with pytest.raises(fxsplit.SpecError, match="pipeline needs 'chunks'"):
        PipelineConfig.coerce({"checkpoint": True})
    with pytest.raises(fxsplit.SpecError, match="must be a PipelineConfig, a mapping or an int \\(got bool\\)"):
        PipelineConfig.coerce(True)
    with pytest.raises(fxsplit.SpecError, match="\\(got str\\)"):
        PipelineConfig.coerce("4")


@pytest.mark.parametrize(
    ("mode", "schedule"),
    [("never", [False] * 4), ("always", [True] * 4), ("except_last", [True, True, True, False])],
)
def test_which_micro_batches_are_checkpointed(mode: str, schedule: list[bool]) -> None:
    config = PipelineConfig(chunks=4, checkpoint=mode)
    assert [config.checkpoints(m, 4) for m in range(4)] == schedule


@pytest.mark.parametrize(("option", "choices"), [("trace", TRACE_MODES), ("objective", OBJECTIVES), ("mode", MODES)])
def test_the_spec_and_the_api_refuse_with_the_same_choices(option: str, choices: tuple[str, ...]) -> None:
    listed = ", ".join(choices)
    with pytest.raises(fxsplit.SpecError) as from_spec:
        load_spec({"devices": {"cpu:0": "1MiB"}, option: "bogus"})
    assert listed in str(from_spec.value)
    with pytest.raises(fxsplit.SpecError) as from_api:
        fxsplit.plan(torch.nn.Linear(2, 2), {"cpu:0": "1MiB"}, **{option: "bogus"})
    assert f"must be one of {listed} (got 'bogus')" in str(from_api.value)
    for choice in choices:  # and each choice is accepted by the spec
        assert load_spec({"devices": {"cpu:0": "1MiB"}, option: choice}).options()[option] == choice
