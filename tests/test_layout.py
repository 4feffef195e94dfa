"""The package's shape: a lazy top level, no torch to read a plan or run ``fxsplit --help``, public names intact."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxsplit

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "networkx", "numpy")


def loaded_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; which heavy packages it left in ``sys.modules``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import fxsplit",
        "import fxsplit.cli",
        "import fxsplit; fxsplit.FxsplitError, fxsplit.Plan, fxsplit.format_size, fxsplit.SpecError",
        "from fxsplit.planning import Plan",
        "import fxsplit.options",
        "import fxsplit.spec",
    ],
)
def test_importing_loads_no_torch(code: str) -> None:
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)


def test_cli_help_loads_no_torch() -> None:
    code = (
        "from fxsplit.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['check', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as done:\n        assert done.code == 0\n"
    )
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)


def test_reading_a_saved_plan_loads_no_torch(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    made = fxsplit.plan(
        model, {"cpu:0": "300B", "cpu:1": "300B"}, example_inputs=(torch.randn(2, 4),), mode="weights", trace="fx"
    )
    assert len({*made.placement.values()}) == 2  # a real split, with cuts to read back
    saved = tmp_path / "plan.yaml"
    saved.write_text(made.to_yaml())
    code = (
        f"from fxsplit.planning import Plan\nplan = Plan.from_yaml(open({str(saved)!r}).read())\n"
        f"assert plan.to_dict() == {made.to_dict()!r}, plan.to_dict()\n"
    )
    assert loaded_after(code) == dict.fromkeys(HEAVY, False)


def test_every_public_name_resolves_to_its_object() -> None:
    assert set(dir(fxsplit)) >= set(fxsplit.__all__)
    assert set(fxsplit.errors.__all__) <= set(fxsplit.__all__)  # every error and warning is public
    for name in fxsplit.__all__:
        value = getattr(fxsplit, name)
        assert getattr(value, "__name__", name) == name, (name, value)
    from fxsplit.api import plan
    from fxsplit.planning.apply import apply

    assert fxsplit.plan is plan and fxsplit.apply is apply


def test_no_public_name_is_also_a_submodule() -> None:
    # Python sets a package's attribute to a submodule when that is imported: fxsplit/plan.py would turn
    # fxsplit.plan from the function into the module as soon as anything imported fxsplit.plan.
    submodules = {found.name for found in pkgutil.iter_modules(fxsplit.__path__)}
    assert {"api", "planning", "pipeline", "tracing"} <= submodules
    assert submodules.isdisjoint(fxsplit.__all__)


def test_public_functions_stay_functions_after_submodules_are_imported() -> None:
    code = (
        "import fxsplit.planning.plan, fxsplit.planning.apply, fxsplit.pipeline.distributed, fxsplit.api\n"
        "import fxsplit.partition.solve, fxsplit.codegen.emitter, fxsplit.tracing.capture\n"
        "import fxsplit, types\n"
        "for name in ('plan', 'apply', 'fxsplit', 'pipeline_stages', 'check_plan', 'show_code'):\n"
        "    value = getattr(fxsplit, name)\n"
        "    assert isinstance(value, types.FunctionType), (name, value)\n"
        "assert fxsplit.partition.partition.__module__ == 'fxsplit.partition.solve'\n"
        "assert fxsplit.tracing.trace.__module__ == 'fxsplit.tracing.capture'\n"
        "assert fxsplit.codegen.emit.__module__ == 'fxsplit.codegen.emitter'\n"
    )
    loaded_after(code)


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nonexistent_name'"):
        fxsplit.nonexistent_name  # noqa: B018
    assert fxsplit.api.plan is fxsplit.plan  # a submodule is reached by attribute, as before the lazy top level
