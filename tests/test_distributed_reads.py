"""A split whose model code branched on ``torch.distributed.is_initialized()`` refuses to run where it answers the
other way.

FLAVA's contrastive head gathers every rank's embeddings when a process group is up (``if not
torch.distributed.is_initialized(): ...local... else: all_gather``). Both tracers run ``forward`` once and keep the
branch they saw: planned outside a job and run inside one (or the other way), such a split computed the other
branch, silently. The read is now noted like the grad mode's (:mod:`fxsplit.tracing.modereads`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import boundcode
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitError
from fxsplit.tracing.modereads import MODE_READS

if dist.is_available():
    from torch.distributed import is_initialized as job_is_up

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")

X = torch.randn(4, 16)
BUDGETS = {"cpu:0": 1200, "cpu:1": 1200}


class GathersInAJob(nn.Module):
    """Takes another branch in a job, as FLAVA's contrastive head does (here one that a job of one rank shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            h = h * torch.distributed.get_world_size() + 1.0
        return self.b(h)


class GathersByName(GathersInAJob):
    """The same branch, through ``from torch.distributed import is_initialized`` (a name of this module's own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if job_is_up():
            h = h * torch.distributed.get_world_size() + 1.0
        return self.b(h)


class GathersThroughHelper(GathersInAJob):
    """The same branch, through a helper module's function that asks by its own name for ``is_initialized``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if boundcode.in_a_job():
            h = h * torch.distributed.get_world_size() + 1.0
        return self.b(h)


class AsksOnly(nn.Module):
    """Reads whether a job is up and computes the same either way."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = 0 if not dist.is_initialized() else 0
        return self.b(torch.relu(self.a(x))) + rank


@contextmanager
def job_of_one() -> Iterator[None]:
    """A gloo process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _split(model: nn.Module, trace: str) -> torch.fx.GraphModule:
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    return split


def _model_and_copy(kind: type[GathersInAJob] = GathersInAJob) -> tuple[GathersInAJob, GathersInAJob]:
    """The model to split, and an unsplit copy of it (the split moves the model's weights)."""
    torch.manual_seed(0)
    model = kind()
    reference = kind()
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("kind", [GathersInAJob, GathersByName, GathersThroughHelper])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_planned_outside_a_job_it_refuses_to_run_in_one(trace: str, kind: type[GathersInAJob]) -> None:
    model, reference = _model_and_copy(kind)
    split = _split(model, trace)
    assert split.mode_read.distributed is False
    outside = reference(X)
    assert torch.allclose(split(X), outside)
    with job_of_one():
        assert not torch.allclose(reference(X), outside)  # the model computes other code in a job
        with pytest.raises(FxsplitError, match=r"traced with torch.distributed not initialized") as info:
            split(X)
        said = str(info.value)
        where = "boundcode.py" if kind is GathersThroughHelper else "test_distributed_reads.py"
        assert where in said and "init_process_group" in said
    assert torch.allclose(split(X), reference(X))  # outside a job again


@pytest.mark.parametrize("kind", [GathersInAJob, GathersByName, GathersThroughHelper])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_planned_in_a_job_it_computes_the_job_s_branch_and_refuses_outside(
    trace: str, kind: type[GathersInAJob]
) -> None:
    model, reference = _model_and_copy(kind)
    with job_of_one():
        split = _split(model, trace)
        assert split.mode_read.distributed is True
        assert torch.allclose(split(X), reference(X))
    with pytest.raises(FxsplitError, match=r"traced with torch.distributed initialized"):
        split(X)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_read_that_changes_nothing_leaves_the_split_free(trace: str) -> None:
    torch.manual_seed(0)
    split = _split(AsksOnly(), trace)
    assert getattr(split, "mode_read", None) is None and MODE_READS not in split.meta
    with job_of_one():
        split(X)


def test_the_function_is_torch_s_after_tracing() -> None:
    real = dist.is_initialized
    _split(GathersByName(), "export")
    assert dist.is_initialized is real and job_is_up is real


def test_torch_s_own_code_gets_the_true_answer_while_the_model_s_is_flipped() -> None:
    """To see whether a graph depends on the answer, the model is traced again with the model's code told the
    other one. torch's logging also asks, then asks for the rank, which fails outside a job: told the other answer
    too, it failed that trace, and a model whose graph depends on nothing was refused in a job (a full test run
    met it)."""
    import os

    from fxsplit.tracing import modereads

    inside_torch = os.path.join(os.path.dirname(torch.__file__), "_logging", "asks.py")
    namespace: dict[str, object] = {"torch": torch}
    exec(compile("def ask():\n    return torch.distributed.is_initialized()\n", inside_torch, "exec"), namespace)  # noqa: S102
    seen: dict[str, bool] = {}
    real = dist.is_initialized

    def traced_under(flip: Callable[[], None]) -> str:
        flip()
        seen["torch"] = namespace["ask"]()  # type: ignore[operator]
        seen["model"] = torch.distributed.is_initialized()
        seen["model, by name"] = job_is_up()
        return "the same graph"

    assert not modereads._differs_distributed("the same graph", traced_under, GathersByName())
    assert seen == {"torch": False, "model": True, "model, by name": True}
    assert dist.is_initialized is real and job_is_up is real  # put back
