"""Generated programs planned at bf16 with float32 weights, against the same program cast (:mod:`standin_fuzz`),
a fixed set of seeds.

Each seed's plan through the bf16 stand-ins must equal the plan of the cast program in every row, leave the
float32 model as it was, and, applied to the cast program, compute what it computes.
``python tests/standin_fuzz.py FIRST LAST`` runs any other range.
"""

from __future__ import annotations

import pytest
from standin_fuzz import run_seed, scenario

pytestmark = pytest.mark.slow  # ~3 s a seed

SEEDS = [  # each trace and mode, 2 and 3 devices (scenario()), of 50000-50086
    50002,  # fx, weights
    50010,  # fx, inference
    50035,  # fx, training, 3 devices: a layer norm's statistics (counted at float32, meta's kernel, before)
    50061,  # fx, training: the same
    50003,  # export, training
    50028,  # export, inference, 3 devices
    50044,  # export, weights, 3 devices
]


def test_the_seeds_cover_each_trace_and_mode() -> None:
    ways = [scenario(seed) for seed in SEEDS]
    assert {(w["trace"], w["mode"]) for w in ways} == {
        (trace, mode) for trace in ("fx", "export") for mode in ("training", "inference", "weights")
    }
    assert {w["devices"] for w in ways} == {2, 3}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_program_planned_at_bf16_gets_the_plan_of_the_cast_program(seed: int) -> None:
    found = run_seed(seed)
    assert found["outcome"] == "equal", found
    assert len(found["used"]) > 1, found  # really split


def test_the_command_runs_each_seed_in_its_own_process_and_says_how_it_went(capsys: pytest.CaptureFixture[str]) -> None:
    import standin_fuzz

    assert standin_fuzz.main(50002, 50003) == 0  # python tests/standin_fuzz.py 50002 50003
    assert capsys.readouterr().out.strip().splitlines()[-1] == "{'equal': 1}"
