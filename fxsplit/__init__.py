"""fxsplit: split a PyTorch model over devices with a declarative graph compiler.

Trace (torch.fx / torch.export) -> partition under per-device memory budgets
-> generate a ``GraphModule`` with ``.to(device)`` copies at the cut edges.

The stages are subpackages, in the order they run: :mod:`fxsplit.tracing` ->
:mod:`fxsplit.cost` -> :mod:`fxsplit.memory` -> :mod:`fxsplit.partition` ->
:mod:`fxsplit.planning` -> :mod:`fxsplit.codegen` -> :mod:`fxsplit.pipeline`;
:mod:`fxsplit.api` wires them. The public names below are imported on first
use (PEP 562), so ``import fxsplit``, reading a plan or ``fxsplit --help``
does not load torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from fxsplit import errors as _errors

__all__ = [
    "BudgetError",
    "CheckpointError",
    "Cut",
    "DeviceError",
    "ExampleInputError",
    "FxsplitError",
    "FxsplitWarning",
    "InputMismatchError",
    "InvariantError",
    "Pipeline",
    "PipelineConfig",
    "PipelineStages",
    "Plan",
    "PlanMismatchError",
    "Replica",
    "RowSplit",
    "Spec",
    "SpecError",
    "TraceError",
    "apply",
    "auto_budgets",
    "check_plan",
    "empty_weights",
    "format_size",
    "from_device_map",
    "fxsplit",
    "load_checkpoint",
    "load_spec",
    "parse_size",
    "pipeline_stages",
    "plan",
    "show_code",
]

__version__ = "0.1.0"

_ERRORS = _errors.__all__  # errors.py is plain Python: importing it loads no torch

# public name -> the module that defines it
_MODULE_OF: dict[str, str] = {
    **dict.fromkeys(_ERRORS, "fxsplit.errors"),
    "Cut": "fxsplit.planning.plan",
    "Plan": "fxsplit.planning.plan",
    "Replica": "fxsplit.planning.plan",
    "RowSplit": "fxsplit.planning.plan",
    "Pipeline": "fxsplit.pipeline.gpipe",
    "PipelineConfig": "fxsplit.options",
    "PipelineStages": "fxsplit.pipeline.distributed",
    "Spec": "fxsplit.spec",
    "apply": "fxsplit.planning.apply",
    "auto_budgets": "fxsplit.memory.autobudget",
    "check_plan": "fxsplit.planning.apply",
    "empty_weights": "fxsplit.checkpoint.empty",
    "format_size": "fxsplit.units",
    "from_device_map": "fxsplit.frommap",
    "fxsplit": "fxsplit.api",
    "load_checkpoint": "fxsplit.checkpoint.load",
    "load_spec": "fxsplit.spec",
    "parse_size": "fxsplit.units",
    "pipeline_stages": "fxsplit.pipeline.distributed",
    "plan": "fxsplit.api",
    "show_code": "fxsplit.codegen.readable",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; or a submodule (``fxsplit.api``)."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups do not come here
        return value
    if not name.startswith("_") and name in {found.name for found in pkgutil.iter_modules(__path__)}:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports these
    from fxsplit.api import fxsplit, plan
    from fxsplit.checkpoint.empty import empty_weights
    from fxsplit.checkpoint.load import load_checkpoint
    from fxsplit.errors import (
        BudgetError,
        CheckpointError,
        DeviceError,
        ExampleInputError,
        FxsplitError,
        FxsplitWarning,
        InputMismatchError,
        InvariantError,
        PlanMismatchError,
        SpecError,
        TraceError,
    )
    from fxsplit.frommap import from_device_map
    from fxsplit.memory.autobudget import auto_budgets
    from fxsplit.options import PipelineConfig
    from fxsplit.pipeline.distributed import PipelineStages, pipeline_stages
    from fxsplit.pipeline.gpipe import Pipeline
    from fxsplit.planning.apply import apply, check_plan
    from fxsplit.planning.plan import Cut, Plan, Replica, RowSplit
    from fxsplit.spec import Spec, load_spec
    from fxsplit.units import format_size, parse_size
