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
    "ExampleInputError",
    "FxsplitError",
    "FxsplitWarning",
    "InputMismatchError",
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


class InputMismatchError(FxsplitError, ValueError):
    """A split traced by ``torch.export`` was called with inputs its graph does not accept.

    The message names the failed check, the inputs it was traced with, and
    how to split for other sizes (``dynamic_shapes``) or values.
    """


class PlanMismatchError(FxsplitError, ValueError):
    """A saved plan does not describe the model it is applied to."""
