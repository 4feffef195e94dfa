"""What the hand-run fuzzes (:mod:`split_fuzz`, :mod:`standin_fuzz`, :mod:`route_fuzz`) share: seeds run each in its
own process, a tally, where in fxsplit an error came from, the loss their training runs take the gradients of, and
what of a run differs from eager's."""

from __future__ import annotations

import json
import operator
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["BAD", "close64", "differences", "run_seeds", "weighted_loss", "where"]

BAD = ("wrong", "crash")


def close64(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal in float64: within 1e-9 of each element, or 1e-12."""
    return torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def _state_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, equal_nan=True)


def differences(
    out: Any,
    expected: Any,
    model: torch.nn.Module,
    reference: torch.nn.Module,
    *,
    close: Callable[[torch.Tensor, torch.Tensor], bool] = close64,
    state_close: Callable[[torch.Tensor, torch.Tensor], bool] = _state_close,
    same: Callable[[Any, Any], bool] = operator.eq,
) -> list[str]:
    """What of a split's run differs from eager's: outputs (tensors by ``close``, other values by ``same``), every
    parameter's gradient (``close``), and the state (``state_close``; a tensor left on ``meta`` differs too); empty
    when nothing does."""
    found = []
    got, want = tree_flatten(out)[0], tree_flatten(expected)[0]
    if len(got) != len(want):
        return [f"{len(got)} outputs, eager gives {len(want)}"]
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape or not close(a.cpu(), e):
                worst = ""
                if isinstance(a, torch.Tensor) and a.shape == e.shape and a.dtype == e.dtype:
                    worst = f" (max abs diff {(a.cpu() - e).abs().max().item():.3g})"
                found.append(f"output {i}{worst}" + (f" {a.dtype}" if isinstance(a, torch.Tensor) else ""))
        elif not same(a, e):
            found.append(f"output {i}: {a!r}, eager {e!r}")
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        g, e = p.grad, grads[name].grad
        if (g is None) != (e is None) or (g is not None and not close(g.cpu(), e)):
            found.append(f"grad of {name}")
    state = reference.state_dict()
    for name, t in model.state_dict().items():
        if t.device.type == "meta":
            found.append(f"state {name} still on meta")
        elif not state_close(t.cpu(), state[name]):
            found.append(f"state {name} ({t.dtype})")
    return found


def weighted_loss(out: Any) -> torch.Tensor:
    """Every floating output that needs a gradient, weighted so the gradients differ from element to element."""
    total = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad):
        weights = torch.linspace(0.5, 1.5, t.numel(), dtype=torch.float64).reshape(t.shape)
        total = total + ((t.double() * weights).sum() * (i + 1)).to("cpu")
    return total


def where(error: BaseException) -> str:
    """``file:line`` of the innermost fxsplit frame of ``error``'s traceback ("" when none)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/fxsplit/" in f.filename]
    return f"{frames[-1].filename.split('/fxsplit/')[-1]}:{frames[-1].lineno}" if frames else ""


def run_seeds(fuzz: str, first: int, last: int, shown: Sequence[str] = (), bad: Sequence[str] = BAD) -> int:
    """Run ``fuzz.run_seed`` for seeds ``[first, last)``, each in its own process (3 minutes at most); print each
    ``bad``, timed-out or ``shown`` row, then the tally. 1 when a seed is bad, else 0."""
    tally: Counter[str] = Counter()
    here = Path(__file__).parent
    for seed in range(first, last):
        code = f"import json, {fuzz}; print(json.dumps({fuzz}.run_seed({seed}), default=str))"
        try:
            ran = subprocess.run(
                [sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=180, check=False
            )
            lines = ran.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if ran.returncode == 0 and lines else None
            if row is None:
                row = {"seed": seed, "outcome": "crash", "error": ran.stderr.strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            row = {"seed": seed, "outcome": "timeout"}
        tally[row["outcome"]] += 1
        if row["outcome"] in (*bad, "timeout", *shown):
            print(json.dumps(row), flush=True)
    print(dict(tally))
    return 1 if any(tally[o] for o in bad) else 0
