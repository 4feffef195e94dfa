"""Load a model for the command line from ``path/to/file.py:factory`` or ``package.module:factory``.

The factory is a callable taking no arguments that returns the model, or
``(model, example_inputs)``, or ``(model, example_inputs, example_kwargs)``,
or a dict with those keys. Example inputs may be a tuple or a single tensor.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxsplit.errors import FxsplitError

__all__ = ["Loaded", "ModelLoadError", "load_model"]


class ModelLoadError(FxsplitError):
    """The model reference is malformed, cannot be imported, or its factory failed."""


@dataclass
class Loaded:
    """A model and the inputs to trace it with."""

    model: torch.nn.Module
    example_inputs: tuple[Any, ...] | None = None
    example_kwargs: dict[str, Any] | None = None


def load_model(reference: str) -> Loaded:
    """Import the factory named by ``reference`` and call it.

    Raises:
        ModelLoadError: says what is wrong and how to write the reference.
    """
    where, colon, name = reference.rpartition(":")
    if not colon or not where or not name:
        raise ModelLoadError(
            f"model {reference!r} must be 'path/to/file.py:factory' or 'package.module:factory' "
            "(a callable returning the model, optionally with example inputs)"
        )
    module = _import(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; callables there: {', '.join(sorted(names)[:12])}"
        raise ModelLoadError(f"{where} has no callable {name!r}{hint}")
    try:
        made = factory()
    except SystemExit as error:
        raise ModelLoadError(f"{reference}() called sys.exit({error.code!r}) instead of returning a model") from error
    except Exception as error:  # noqa: BLE001 - the user's code may raise anything
        raise ModelLoadError(f"{reference}() raised {type(error).__name__}: {error}") from error
    return _unpack(made, reference)


def _import(where: str) -> Any:
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ModelLoadError(f"no such file: '{where}'")
        module_name = f"_fxsplit_model_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ModelLoadError(f"cannot import '{where}' as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except SystemExit as error:
            raise ModelLoadError(
                f"importing '{where}' called sys.exit({error.code!r}); guard the script's main code "
                "with if __name__ == '__main__':"
            ) from error
        except Exception as error:  # noqa: BLE001
            raise ModelLoadError(f"importing '{where}' raised {type(error).__name__}: {error}") from error
        return module
    try:
        return importlib.import_module(where)
    except SystemExit as error:
        raise ModelLoadError(
            f"importing module {where!r} called sys.exit({error.code!r}); guard its main code with "
            "if __name__ == '__main__':"
        ) from error
    except Exception as error:  # noqa: BLE001
        raise ModelLoadError(f"cannot import module {where!r}: {type(error).__name__}: {error}") from error


def _unpack(made: Any, reference: str) -> Loaded:
    if isinstance(made, dict):
        unknown = set(made) - {"model", "example_inputs", "example_kwargs"}
        if unknown or "model" not in made:
            raise ModelLoadError(
                f"{reference}() returned a dict; it needs 'model' and may have 'example_inputs', "
                f"'example_kwargs' (got keys {sorted(made)})"
            )
        made = (made["model"], made.get("example_inputs"), made.get("example_kwargs"))
    if isinstance(made, torch.nn.Module):
        return Loaded(made)
    if isinstance(made, tuple) and made and isinstance(made[0], torch.nn.Module) and len(made) <= 3:
        inputs = made[1] if len(made) > 1 else None
        if inputs is not None and not isinstance(inputs, tuple):
            inputs = tuple(inputs) if isinstance(inputs, list) else (inputs,)
        kwargs = made[2] if len(made) > 2 else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ModelLoadError(f"{reference}() returned example kwargs of type {type(kwargs).__name__}; use a dict")
        return Loaded(made[0], inputs, kwargs)
    raise ModelLoadError(
        f"{reference}() must return an nn.Module, or (module, example_inputs[, example_kwargs]) "
        f"(got {type(made).__name__})"
    )
