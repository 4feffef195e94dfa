"""Generated training programs (:mod:`random_programs`) planned at growing budgets: a fuzz to run by hand.

Each seed's program is planned for training (SGD, torch.fx) on one device, then over three devices at each part of
:data:`PARTS` of that one-device total. :func:`run_seed` says how the plans went as the budgets grew:

* ``monotone``: no budget was refused after a smaller one fitted, and none copies more bytes than a smaller one;
* ``more_bytes``: a larger budget copies more bytes per forward than a smaller one (the partitioner's heuristics are
  not monotone on graphs too large to search exactly; docs/MEMORY.md);
* ``refused_larger``: a budget was refused after a smaller one fitted (a plan that fits the smaller budgets
  fits the larger ones: the fit loop should find one);
* ``skipped``: the program does not plan on one device; ``crash``: any other exception.

By hand, every seed in its own process::

    python tests/budget_fuzz.py 14060 14171        # seeds [14060, 14171): each refused_larger or more_bytes row

It exits 1 when a seed is ``refused_larger`` or ``crash``.
"""

from __future__ import annotations

import sys
from typing import Any

from fuzzrun import run_seeds, where
from random_programs import generate

import fxsplit

__all__ = ["PARTS", "run_seed"]

PARTS = (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9)
OPTIONS = {"mode": "training", "optimizer": "sgd", "trace": "fx"}


def run_seed(seed: int) -> dict[str, Any]:
    """Plan ``seed``'s program at each of :data:`PARTS`: ``{"seed", "outcome", "copied"}``, ``copied`` the bytes
    each part's plan copies per forward (None: refused)."""
    source, _ = generate(seed)
    namespace: dict[str, Any] = {"__name__": "program"}
    exec(compile(source, f"<program {seed}>", "exec"), namespace)  # noqa: S102 (our own generated source)
    try:
        model, args = namespace["make"]()
        total = fxsplit.plan(model, {"cpu:0": 1 << 34}, example_inputs=args, **OPTIONS).memory["cpu:0"]["total"]
    except Exception as error:  # noqa: BLE001 - the generator makes some programs that do not run
        return {"seed": seed, "outcome": "skipped", "error": f"{type(error).__name__}: {error}"[:200]}
    copied: list[int | None] = []
    for part in PARTS:
        budgets = {f"cpu:{k}": int(total * part) for k in range(3)}
        try:
            plan = fxsplit.plan(model, budgets, example_inputs=args, **OPTIONS)
        except fxsplit.BudgetError:
            copied.append(None)
            continue
        except Exception as error:  # noqa: BLE001 - any other error is a finding
            return {"seed": seed, "outcome": "crash", "part": part, "error": f"{error}"[:300], "at": where(error)}
        over = [d for d, row in plan.memory.items() if row["total"] > budgets[d]]
        if over:
            return {"seed": seed, "outcome": "crash", "part": part, "error": f"over the budget on {over}"}
        copied.append(plan.copied_bytes)
    fitted = [i for i, c in enumerate(copied) if c is not None]
    result = {"seed": seed, "copied": dict(zip(PARTS, copied, strict=True))}
    if fitted and any(copied[i] is None for i in range(fitted[0], len(PARTS))):
        return {**result, "outcome": "refused_larger"}
    made = [c for c in copied if c is not None]
    if any(later > min(made[:i]) for i, later in enumerate(made) if i):
        return {**result, "outcome": "more_bytes"}
    return {**result, "outcome": "monotone"}


def main(first: int, last: int) -> int:
    """Run seeds ``[first, last)``, each in its own process; print the tally (:func:`fuzzrun.run_seeds`)."""
    bad = ("refused_larger", "crash")
    return run_seeds("budget_fuzz", first, last, shown=("more_bytes", *bad), bad=bad)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
