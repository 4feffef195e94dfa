"""The exceptions fxsplit raises.

Every error derives from :class:`FxsplitError`. Errors about bad input that a
user can fix by changing a value (budgets, specs, plans, example inputs) are
also :class:`ValueError`, so code that already catches ``ValueError`` keeps
working. What fxsplit did instead of what was asked (a fallback, a plan that
counts less than its mode promises) is a :class:`FxsplitWarning`.
"""

from __future__ import annotations

__all__ = [
    "BudgetError",
    "CheckpointError",
    "DeviceError",
    "ExampleInputError",
    "FxsplitError",
    "FxsplitWarning",
    "InputMismatchError",
    "InvariantError",
    "PlanMismatchError",
    "SpecError",
    "TraceError",
]


class FxsplitError(Exception):
    """Root of every error fxsplit raises on purpose."""


class BudgetError(FxsplitError, ValueError):
    """The model (or a part of it that cannot be split) does not fit the budgets.

    The message says what does not fit, on which device, and by how many bytes.
    """


class CheckpointError(FxsplitError, ValueError):
    """A checkpoint cannot be loaded into the model or split it was given for.

    The message lists every problem at once (tensors missing, unexpected, of
    another shape or dtype, buffers that cannot be materialised), each with
    the file it came from; ``problems`` holds the same lines. Nothing was
    loaded or moved.
    """

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class TraceError(FxsplitError):
    """The model could not be turned into an FX graph.

    The message carries torch's reason and what to try next.
    """


class ExampleInputError(TraceError, ValueError):
    """The model cannot run on the example inputs (a wrong size, a list where a tensor goes, an unknown keyword).

    The message names each example input with its shape and dtype, gives the
    model's complaint (and the line of the model that made it) and the fix.
    A :class:`TraceError`, so code catching tracing failures keeps working.
    """


class FxsplitWarning(UserWarning):
    """fxsplit did something other than what was asked, and the result is weaker for it.

    For instance: torch.export failed and the model was traced by torch.fx,
    or the plan does not count activations its memory ``mode`` counts.
    """


class SpecError(FxsplitError, ValueError):
    """An argument, option or spec value is malformed or inconsistent."""


class DeviceError(FxsplitError, RuntimeError):
    """A device the split needs cannot be used here, or moving weights onto it failed.

    Raised before any weight moves when a device is absent (no CUDA, an index
    beyond those visible); the message lists the devices torch sees. When a
    move fails part way (out of memory), the tensors already moved are put
    back first, so the model is as it was.
    """


class InputMismatchError(FxsplitError, ValueError):
    """A split traced by ``torch.export`` was called with inputs its graph does not accept.

    The message names the failed check, the inputs it was traced with, and
    how to split for other sizes (``dynamic_shapes``) or values.
    """


class PlanMismatchError(FxsplitError, ValueError):
    """A saved plan does not describe the model it is applied to."""


class InvariantError(FxsplitError, AssertionError):
    """A plan or a split module breaks one of fxsplit's invariants (``check=True``, :mod:`fxsplit.check`).

    The message lists every violation. It is a bug in fxsplit, or a plan edited by hand, never bad input.
    """
