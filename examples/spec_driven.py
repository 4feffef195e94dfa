"""Spec-driven splitting: a YAML spec in, a plan you can keep out, the same split re-applied later.

Runs anywhere: the spec (examples/spec_example.yaml) uses logical CPU devices cpu:0..cpu:2.

    python examples/spec_driven.py
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

import fxsplit
from fxsplit.factory import load_model

HERE = Path(__file__).resolve().parent
SPEC = HERE / "spec_example.yaml"


def main() -> None:
    loaded = load_model(f"{HERE / 'models.py'}:factory")
    model, inputs = loaded.model, loaded.example_inputs
    assert inputs is not None
    fresh = copy.deepcopy(model)  # to re-apply the saved plan to, as on another machine
    expected = model(*inputs)

    print(f"--- spec ({SPEC.name}) ---")
    print(SPEC.read_text().strip())

    gm = fxsplit.fxsplit(model, spec=SPEC, example_inputs=inputs)
    plan = gm.meta["fxsplit_plan"]
    print("\n--- plan ---")
    print(plan)
    torch.testing.assert_close(gm(*inputs), expected)
    difference = float((gm(*inputs) - expected).detach().abs().max())
    print(f"\nsplit output == unsplit output (max |diff| {difference:.1e})")

    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "plan.yaml"
        saved.write_text(plan.to_yaml())
        print(f"\n--- the top of the saved plan ({saved.stat().st_size} bytes) ---")
        print("\n".join(saved.read_text().splitlines()[3:30]))
        again = fxsplit.apply(fresh, fxsplit.Plan.from_yaml(saved.read_text()), example_inputs=inputs)
    assert again.code == gm.code
    torch.testing.assert_close(again(*inputs), expected)
    print("\nre-applied from the file without solving: same generated code, same outputs")

    print("\n--- the copies in the generated forward, and the reads of replicas (no copy) ---")
    lines = gm.code.strip().splitlines()
    print("\n".join([lines[0], *(line for line in lines if ".to('cpu:" in line or "replica(" in line), lines[-1]]))


if __name__ == "__main__":
    main()
