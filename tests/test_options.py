"""Option choices and the pipeline option's value (fxsplit.options): plain data, validated when made."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import fxsplit
from fxsplit.options import BATCH_STATS_MODES, CHECKPOINT_MODES, MODES, OBJECTIVES, TRACE_MODES, PipelineConfig
from fxsplit.spec import load_spec


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
