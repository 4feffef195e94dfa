"""Loading a model for the command line (fxsplit.factory): references, factories and what they return."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from fxsplit.errors import FxsplitError
from fxsplit.factory import Loaded, ModelLoadError, load_model

FACTORIES = """
import torch

def plain():
    return torch.nn.Linear(2, 3)

def with_tensor():
    return torch.nn.Linear(2, 3), torch.ones(4, 2)

def with_list():
    return torch.nn.Linear(2, 3), [torch.ones(4, 2), 5]

def with_kwargs():
    return torch.nn.Linear(2, 3), (torch.ones(4, 2),), {"flag": True}

def as_dict():
    return {"model": torch.nn.Linear(2, 3), "example_kwargs": {"flag": False}}

def dict_without_model():
    return {"example_inputs": ()}

def dict_with_more():
    return {"model": torch.nn.Linear(2, 3), "budgets": {}}

def kwargs_not_a_dict():
    return torch.nn.Linear(2, 3), (), [("flag", True)]

def too_long():
    return torch.nn.Linear(2, 3), (), {}, "extra"

def not_a_model():
    return "linear"

def broken():
    raise RuntimeError("no weights here")

NOT_CALLABLE = 3
"""


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[str]:
    """A package importable by name, removed from sys.path and sys.modules after the test."""
    (tmp_path / "pkg_fxsplit_models").mkdir()
    (tmp_path / "pkg_fxsplit_models" / "__init__.py").write_text("")
    (tmp_path / "pkg_fxsplit_models" / "zoo.py").write_text(FACTORIES)
    sys.path.insert(0, str(tmp_path))
    yield "pkg_fxsplit_models.zoo"
    sys.path.remove(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("pkg_fxsplit_models")]:
        del sys.modules[name]


def test_a_factory_may_return_the_model_alone(factories: Path) -> None:
    loaded = load_model(f"{factories}:plain")
    assert isinstance(loaded, Loaded) and isinstance(loaded.model, torch.nn.Linear)
    assert loaded.example_inputs is None and loaded.example_kwargs is None


def test_example_inputs_become_a_tuple(factories: Path) -> None:
    single = load_model(f"{factories}:with_tensor").example_inputs
    assert isinstance(single, tuple) and len(single) == 1 and single[0].shape == (4, 2)
    listed = load_model(f"{factories}:with_list").example_inputs
    assert isinstance(listed, tuple) and len(listed) == 2 and listed[1] == 5
    loaded = load_model(f"{factories}:with_kwargs")
    assert loaded.example_kwargs == {"flag": True} and len(loaded.example_inputs or ()) == 1
    as_dict = load_model(f"{factories}:as_dict")
    assert as_dict.example_inputs is None and as_dict.example_kwargs == {"flag": False}


def test_a_module_path_imports_like_a_file(on_path: str) -> None:
    loaded = load_model(f"{on_path}:with_kwargs")
    assert isinstance(loaded.model, torch.nn.Linear) and loaded.example_kwargs == {"flag": True}


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("dict_without_model", "returned a dict; it needs 'model' and may have 'example_inputs', 'example_kwargs'"),
        ("dict_with_more", "(got keys ['budgets', 'model'])"),
        ("kwargs_not_a_dict", "returned example kwargs of type list; use a dict"),
        ("too_long", "must return an nn.Module, or (module, example_inputs[, example_kwargs]) (got tuple)"),
        ("not_a_model", "(got str)"),
        ("broken", "broken() raised RuntimeError: no weights here"),
        ("NOT_CALLABLE", "has no callable 'NOT_CALLABLE'; callables there: "),
        ("plian", "has no callable 'plian'; did you mean 'plain'?"),
    ],
)
def test_what_a_factory_gets_wrong_is_said(factories: Path, factory: str, message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{factories}:{factory}")
    assert message in str(info.value)
    assert isinstance(info.value, FxsplitError)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("examples/models.py", "must be 'path/to/file.py:factory' or 'package.module:factory'"),
        (":factory", "must be 'path/to/file.py:factory'"),
        ("module:", "must be 'path/to/file.py:factory'"),
        ("no/such/file.py:factory", "no such file: 'no/such/file.py'"),
        ("no_such_module_fxsplit:factory", "cannot import module 'no_such_module_fxsplit': ModuleNotFoundError"),
    ],
)
def test_malformed_or_missing_references(reference: str, message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(reference)
    assert message in str(info.value)


def test_a_file_that_fails_to_import_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nraise ValueError('half written')\n")
    with pytest.raises(ModelLoadError, match=r"importing '.*bad.py' raised ValueError: half written"):
        load_model(f"{bad}:factory")
