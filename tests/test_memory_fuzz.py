"""Generated programs planned, run, and measured (:mod:`memory_fuzz`), a fixed set of seeds.

Each seed's split runs once under the allocator's meter (a forward under ``torch.no_grad()`` in inference, a forward
and a backward in training), and no device may hold more than the activation peak its plan charged it: the budget
promise. ``python tests/memory_fuzz.py FIRST LAST`` runs any other range (``tests/test_backward_memory.py`` holds
the training seeds an earlier fuzz found below the allocator).
"""

from __future__ import annotations

import pytest
from memory_fuzz import run_seed, scenario

pytestmark = pytest.mark.slow  # ~3 s a seed

SEEDS = [  # each trace and mode, 2 and 3 devices, all split over two devices (of 70000-70199)
    70012,  # fx, inference; the meter counted the 0-dim tensor of a wrapped number, 8 B over the plan
    70033,  # export, inference
    70026,  # export, training; 8 B over before, the number of a division autograd keeps for the backward
    70010,  # fx, training, 3 devices
    70006,  # export, training, 3 devices
]


def test_the_seeds_cover_each_way_of_planning() -> None:
    ways = [scenario(seed) for seed in SEEDS]
    assert {w["trace"] for w in ways} == {"fx", "export"}
    assert {w["mode"] for w in ways} == {"training", "inference"}
    assert {w["devices"] for w in ways} == {2, 3}


@pytest.mark.parametrize("seed", SEEDS)
def test_no_device_holds_more_than_its_plan_charges(seed: int) -> None:
    found = run_seed(seed)
    assert found["outcome"] == "within", found
    assert len(found["used"]) > 1, found  # really split
