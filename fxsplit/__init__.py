"""fxsplit: split a PyTorch model over devices with a declarative graph compiler.

Trace (torch.fx / torch.export) -> partition under per-device memory budgets
-> generate a ``GraphModule`` with ``.to(device)`` copies at the cut edges.
"""

from fxsplit.api import fxsplit, plan
from fxsplit.apply_plan import apply, check_plan
from fxsplit.autobudget import auto_budgets
from fxsplit.checkpoint import empty_weights, load_checkpoint
from fxsplit.distributed import PipelineStages, pipeline_stages
from fxsplit.errors import (
    BudgetError,
    CheckpointError,
    DeviceError,
    ExampleInputError,
    FxsplitError,
    FxsplitWarning,
    InputMismatchError,
    PlanMismatchError,
    SpecError,
    TraceError,
)
from fxsplit.pipeline import Pipeline, PipelineConfig
from fxsplit.plan import Cut, Plan
from fxsplit.readable import show_code
from fxsplit.spec import Spec, load_spec
from fxsplit.units import format_size, parse_size

__all__ = [
    "BudgetError",
    "CheckpointError",
    "Cut",
    "DeviceError",
    "ExampleInputError",
    "FxsplitError",
    "FxsplitWarning",
    "InputMismatchError",
    "Pipeline",
    "PipelineConfig",
    "PipelineStages",
    "Plan",
    "PlanMismatchError",
    "Spec",
    "SpecError",
    "TraceError",
    "apply",
    "auto_budgets",
    "check_plan",
    "empty_weights",
    "format_size",
    "fxsplit",
    "load_checkpoint",
    "load_spec",
    "parse_size",
    "pipeline_stages",
    "plan",
    "show_code",
]

__version__ = "0.1.0"
