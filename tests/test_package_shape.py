"""The package's shape (STYLE.md): short modules, and a sorted ``__all__`` whose every name resolves.

Modules stay under MAX_LINES lines ("files under ~400 lines"; one concept per file). Every module has an
``__all__`` that names only what the module defines or imports, once; the top level and each stage
subpackage list theirs sorted, so a reader finds a name and a diff shows one line per change. (The lazy
top level and the import-time checks are in test_layout.py.)
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import fxsplit

MAX_LINES = 420
PACKAGE = Path(fxsplit.__file__).parent
MODULES = sorted(path.relative_to(PACKAGE.parent).as_posix() for path in PACKAGE.rglob("*.py"))
PACKAGES = ["fxsplit"] + sorted(info.name for info in pkgutil.walk_packages(fxsplit.__path__, "fxsplit.") if info.ispkg)
IMPORTABLE = ["fxsplit"] + sorted(
    info.name for info in pkgutil.walk_packages(fxsplit.__path__, "fxsplit.") if not info.name.endswith("__main__")
)


def test_the_lists_cover_the_package() -> None:
    assert "fxsplit/partition/solve.py" in MODULES and "fxsplit/tracing/graphinfo.py" in MODULES
    assert {"fxsplit.tracing", "fxsplit.cost", "fxsplit.memory", "fxsplit.partition"} <= set(PACKAGES)
    assert {"fxsplit.planning", "fxsplit.codegen", "fxsplit.pipeline", "fxsplit.checkpoint"} <= set(PACKAGES)
    assert len(IMPORTABLE) == len(MODULES) - 1  # every file but __main__.py is a module imported below


@pytest.mark.parametrize("module", MODULES)
def test_module_is_short(module: str) -> None:
    lines = len((PACKAGE.parent / module).read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"{module} has {lines} lines; split it by job (STYLE.md: files under ~400 lines)"


@pytest.mark.parametrize("name", PACKAGES)
def test_package_all_is_sorted(name: str) -> None:
    names = list(importlib.import_module(name).__all__)
    assert names == sorted(names), f"{name}.__all__ is not sorted: {names}"


@pytest.mark.parametrize("name", IMPORTABLE)
def test_every_name_in_all_resolves_once(name: str) -> None:
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__: say what it offers"
    names = list(module.__all__)
    assert all(isinstance(item, str) for item in names), names
    assert len(set(names)) == len(names), f"{name}.__all__ lists a name twice: {names}"
    missing = [item for item in names if not hasattr(module, item)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
