"""The keyword options of the public entry points, checked and coerced into :class:`~fxsplit.options.Options`."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from fxsplit.errors import SpecError
from fxsplit.hardware import Hardware
from fxsplit.memory.model import MemorySpec
from fxsplit.options import OBJECTIVES, TRACE_MODES, Offload, Options, PipelineConfig
from fxsplit.tracing.dynamic import describe as describe_dynamic
from fxsplit.validate import check_option_types

__all__ = ["OPTION_NAMES", "parse_options"]

OPTION_NAMES = tuple(Options.__dataclass_fields__)


def parse_options(raw: Mapping[str, Any]) -> Options:
    """``Options(**raw)``, each option checked (unknown names get a close match), the nested ones coerced.

    Raises:
        SpecError: an unknown option, or a value of the wrong type or out of range.
    """
    for name in raw:
        if name not in OPTION_NAMES:
            close = difflib.get_close_matches(name, (*OPTION_NAMES, "example_inputs"), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; options are {', '.join(OPTION_NAMES)}"
            raise SpecError(f"unknown option {name!r}{hint}")
    check_option_types(raw)
    options = Options(**raw)
    if options.pipeline is not None:
        options = dataclasses.replace(options, pipeline=PipelineConfig.coerce(options.pipeline))
    if options.trace not in TRACE_MODES:
        raise SpecError(f"trace must be one of {', '.join(TRACE_MODES)} (got {options.trace!r})")
    if options.objective is not None and options.objective not in OBJECTIVES:
        raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)} (got {options.objective!r})")
    MemorySpec.coerce(options.mode, options.optimizer)
    if options.accumulate_grads and options.mode != "training":
        raise SpecError(
            f"accumulate_grads=True only counts with mode='training' (got mode={options.mode!r}); pass "
            "mode='training' or drop it"
        )
    if options.offload is not None:
        options = dataclasses.replace(options, offload=Offload.coerce(options.offload))
    if options.hardware is not None:
        options = dataclasses.replace(options, hardware=Hardware.coerce(options.hardware))
    describe_dynamic(options.dynamic_shapes)
    return options
