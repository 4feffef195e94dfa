"""What ``forward`` assigns to Python attributes is put back after tracing, and said (fxsplit/tracing/pythonstate.py).

Before, ``fxsplit.plan`` of a model whose forward runs ``self.calls += 1`` left ``calls`` incremented under torch.fx
(plan must not change the model), and neither route said that the split computes with the traced value.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitWarning, TraceError

BUDGETS = {"cpu:0": 2000, "cpu:1": 2000}
X = torch.randn(4, 16)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.calls = 0
        self.scale = 1.0
        self.flag = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.scale = self.scale * 0.5  # used below: the model's next call computes with 0.25
        self.flag = True  # the same value: nothing to say
        self._seen = True  # private bookkeeping (transformers' flags): put back, not said
        if not hasattr(self, "lazy"):
            self.lazy = 3  # made on the first call: put back (removed), not said
        return self.a(x) * self.scale


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Counting(), Counting(), nn.Linear(16, 4))


def _state(m: nn.Module) -> list[dict[str, object]]:
    return [{k: v for k, v in vars(c).items() if not k.startswith("_") or k == "_seen"} for c in m[:2]]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_plan_puts_back_what_forward_assigns_and_says_which_values_the_split_keeps(trace: str) -> None:
    m = model()
    before = _state(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxsplit.plan(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    assert _state(m) == before
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "assigns" in str(w.message)]
    assert len(said) == 1, said
    assert "0.calls (0 -> 1), 0.scale (1.0 -> 0.5), 1.calls (0 -> 1), 1.scale (1.0 -> 0.5)" in said[0]
    assert "flag" not in said[0] and "_seen" not in said[0] and "lazy" not in said[0]
    assert [w.filename for w in caught if "assigns" in str(w.message)] == [__file__]


def test_a_model_that_only_updates_buffers_in_place_is_planned_without_a_word() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        for trace in ("fx", "export"):
            fxsplit.plan(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    assert int(m[1].num_batches_tracked) == 0


STEPS = 0
WARMUP = True
_PRIVATE = 0
HELPER: object = None


class GlobalSteps(nn.Module):
    """Counts its calls in a global and leaves warm-up after three: the graph keeps the branch traced."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global STEPS, WARMUP, _PRIVATE, HELPER
        STEPS += 1
        _PRIVATE += 1
        if HELPER is None:
            HELPER = object()  # a lazily made object: not a plain value, left as the code made it
        if STEPS > 3:
            WARMUP = False
        return self.a(x) * (2.0 if WARMUP else 1.0)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_global_that_forward_assigns_is_put_back_and_said(trace: str) -> None:
    """Before, ``STEPS`` was left incremented by ``fxsplit.plan`` (by each run of forward), with no word."""
    global STEPS, WARMUP, _PRIVATE, HELPER
    STEPS, WARMUP, _PRIVATE, HELPER = 3, True, 0, None
    with pytest.warns(FxsplitWarning, match=r"assigns global test_python_state.STEPS \(3 -> \d+\).*WARMUP"):
        fxsplit.plan(GlobalSteps(), BUDGETS, example_inputs=(X,), trace=trace)
    assert (STEPS, WARMUP, _PRIVATE) == (3, True, 0)  # put back as they were
    assert HELPER is not None


RUNNING = torch.zeros(16)
LATEST: torch.Tensor | None = None


class GlobalTensors(nn.Module):
    """``running``: a running value kept in a global tensor (read, bound anew); else the latest output recorded."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.how = nn.Linear(16, 16), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global RUNNING, LATEST
        y = self.a(x)
        if self.how == "running":
            RUNNING = RUNNING * 0.5 + y.sum(0)
            return y + RUNNING
        LATEST = y
        return y


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_global_tensor_forward_reads_and_binds_anew_is_refused_and_put_back(trace: str) -> None:
    """Before, it was split without a word: each call of the split started from the value traced, so its outputs
    differed from the model's from the second call on, and the global held the trace's tensor afterwards."""
    global RUNNING
    RUNNING = running = torch.zeros(16)
    with pytest.raises(TraceError, match=r"anew to tensors it computes: the global test_python_state\.RUNNING\."):
        fxsplit.plan(GlobalTensors("running"), BUDGETS, example_inputs=(X,), trace=trace)
    assert RUNNING is running and not RUNNING.any()


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_global_tensor_bound_but_not_read_is_put_back_said_and_splits(trace: str) -> None:
    """The latest output, kept for the user: a record made anew at each call, not state. The split's outputs
    equal the model's at every call; the global is put back (None), and the warning says it."""
    global LATEST
    LATEST = None
    model = GlobalTensors("latest")
    with pytest.warns(FxsplitWarning, match=r"global test_python_state\.LATEST \(None -> a tensor it computes\)"):
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert LATEST is None
    for _ in range(3):
        assert torch.equal(split(X), model(X))


def test_a_global_forward_reads_only_is_left_alone_and_unsaid() -> None:
    global STEPS, WARMUP

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) * (2.0 if WARMUP else 1.0) + STEPS

    STEPS, WARMUP = 5, False
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        fxsplit.plan(Reads(), BUDGETS, example_inputs=(X,), trace="fx")
    assert (STEPS, WARMUP) == (5, False)
