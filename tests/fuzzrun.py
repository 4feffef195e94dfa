"""What the hand-run fuzzes (:mod:`split_fuzz`, :mod:`standin_fuzz`) share: seeds run each in its own process, a
tally, and where in fxsplit an error came from."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Sequence

__all__ = ["BAD", "run_seeds", "where"]

BAD = ("wrong", "crash")


def where(error: BaseException) -> str:
    """``file:line`` of the innermost fxsplit frame of ``error``'s traceback ("" when none)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/fxsplit/" in f.filename]
    return f"{frames[-1].filename.split('/fxsplit/')[-1]}:{frames[-1].lineno}" if frames else ""


def run_seeds(fuzz: str, first: int, last: int, shown: Sequence[str] = ()) -> int:
    """Run ``fuzz.run_seed`` for seeds ``[first, last)``, each in its own process (3 minutes at most); print each
    bad, timed-out or ``shown`` row, then the tally. 1 when a seed is bad, else 0."""
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
        if row["outcome"] in (*BAD, "timeout", *shown):
            print(json.dumps(row), flush=True)
    print(dict(tally))
    return 1 if any(tally[o] for o in BAD) else 0
