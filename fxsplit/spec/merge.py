"""A spec's budgets and options merged with those a call passes: :func:`merge_spec` (the call wins)."""

from __future__ import annotations

from typing import Any, Mapping

from fxsplit.errors import SpecError
from fxsplit.spec.schema import Spec

__all__ = ["merge_spec"]


def merge_spec(spec: Spec, budgets: Any, options: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Budgets and options from ``spec``, overridden by what the caller passed explicitly.

    Explicit ``budgets`` replace the spec's devices (their reserves apply to
    devices of the same name); an explicit ``reserve`` replaces the spec's. Every
    other option replaces the spec's field whole: ``offload={"host": "8GiB"}``
    drops the spec's disk, ``offload=None`` turns offload off (the command line
    merges its offload flags into the spec's field by field instead).
    """
    merged = {**spec.options(), **options}
    chosen = budgets if budgets is not None else (dict(spec.devices) or None)
    if "reserve" not in options and chosen is not None and (spec.reserve or spec.default_reserve):
        merged["reserve"] = {key: spec.reserve_for(_device_or_key(key)) for key in chosen}
    return chosen, merged


def _device_or_key(key: Any) -> Any:
    from fxsplit.devices import normalize_device  # loads torch: importing the spec does not

    try:
        return normalize_device(key)
    except SpecError:
        return key
