"""The whole ``fxsplit.plan()`` call, timed stage by stage, on deep MLPs of 1k to 100k ops.

:func:`timed_stages` wraps the functions :func:`fxsplit.plan` calls (looked up
in :mod:`fxsplit.api` and :mod:`fxsplit.plangraph` at call time) with timers, so one ordinary ``plan()``
call is split into:

* ``trace``: torch.fx / torch.export;
* ``build``: the constraints check and the cost model (:func:`fxsplit.cost.build_problem`);
* ``memory``: the memory model, with the activation profile on fake tensors
  when the mode counts activations;
* ``partition``: :func:`fxsplit.partition.partition` (every call of the budget fit loop);
* ``make_plan``: :func:`fxsplit.planning.make_plan` (names, homes, cuts);
* ``other``: the rest of the call (budgets, leaf modules, fingerprint, the fit loop itself).

``plan() - trace`` should grow linearly with the ops and stay within a small
factor of ``partition``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import wraps
from typing import Any, Callable, Iterator, Sequence

import torch

import fxsplit
import fxsplit.api as api
import fxsplit.plangraph as plangraph
from benchmarks.measure import fit_slope, median
from benchmarks.models import MLP

__all__ = ["PLAN_SIZES", "QUICK_PLAN_SIZES", "STAGES", "plan_scaling", "timed_plan", "timed_stages"]

PLAN_SIZES = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
QUICK_PLAN_SIZES = (1_000, 2_000)
STAGES = ("trace", "build", "memory", "partition", "make_plan", "other")
_WRAPPED: dict[str, tuple[tuple[Any, str], ...]] = {  # stage -> (module, name) of each function it times
    "trace": ((api, "trace"),),
    "build": ((api, "check_constraints"), (plangraph, "build_problem")),
    "memory": ((plangraph, "memory_model"),),
    "partition": ((plangraph, "partition"),),
    "make_plan": ((plangraph, "make_plan"),),
}


@contextmanager
def timed_stages() -> Iterator[dict[str, float]]:
    """Seconds spent in each stage of the ``fxsplit.plan()`` calls made inside the block."""
    spent = dict.fromkeys(STAGES, 0.0)
    originals = {(module, name): getattr(module, name) for found in _WRAPPED.values() for module, name in found}

    def timer(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - start

        return timed

    for stage, found in _WRAPPED.items():
        for module, name in found:
            setattr(module, name, timer(stage, originals[(module, name)]))
    try:
        yield spent
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def timed_plan(
    model: torch.nn.Module, budgets: dict[str, int], inputs: tuple[Any, ...], **options: Any
) -> dict[str, float]:
    """One ``fxsplit.plan()`` call: seconds per stage, ``total`` and ``untraced`` (total less trace)."""
    with timed_stages() as spent:
        start = time.perf_counter()
        fxsplit.plan(model, budgets, example_inputs=inputs, **options)
        total = time.perf_counter() - start
    spent["other"] = total - sum(spent[s] for s in STAGES if s != "other")
    return {**spent, "total": total, "untraced": total - spent["trace"]}


def _mlp_case(ops: int) -> tuple[torch.nn.Module, dict[str, int], tuple[torch.Tensor]]:
    """A deep MLP of about ``ops`` ops (a Linear and a relu per block), 4 devices at 1.2 x total / 4."""
    model = MLP(dim=8, depth=max(1, ops // 2)).eval()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, {f"cpu:{k}": int(1.2 * total / 4) for k in range(4)}, (torch.randn(2, 8),)


def plan_scaling(sizes: Sequence[int], repeats: int, mode: str = "weights") -> dict[str, Any]:
    """Per size, the median stage times of ``fxsplit.plan(trace="fx")`` on a deep MLP, and log-log slopes."""
    points = []
    for ops in sizes:
        model, budgets, inputs = _mlp_case(ops)
        reps = repeats if ops <= 10_000 else 1
        runs = [timed_plan(model, budgets, inputs, trace="fx", mode=mode) for _ in range(reps)]
        point = {key: median([run[key] for run in runs]) for key in runs[0]}
        points.append({"ops": ops, "repeats": reps, **point})
    xs = [p["ops"] for p in points]
    slopes = {key: fit_slope(xs, [max(p[key], 1e-6) for p in points]) for key in ("untraced", "partition", "trace")}
    return {"mode": mode, "points": points, "slopes": slopes}
