"""Generated programs split and compared with eager (:mod:`split_fuzz`), a fixed set of seeds.

The programs hold what hand-written models rarely combine: views and slices written in place, ``split``/``unbind``
items, ``cat``/``stack``, attention, losses and detached outputs. Each seed here is split over 2-3 devices as
:func:`split_fuzz.scenario` says and must compute, in float64, eager's outputs, gradients and buffers, with no op
mixing devices. ``python tests/split_fuzz.py FIRST LAST`` runs any other range.
"""

from __future__ import annotations

import pytest
from split_fuzz import run_seed, scenario

pytestmark = pytest.mark.slow  # ~5 s a seed

SEEDS = [  # each trace, mode, pins and budgets, 2 and 3 devices, replicas or not (scenario()), of 40000-41149
    40000,  # fx, inference, 3 devices pinned, replicas
    40001,  # export, training, pinned
    40003,  # export, training, budgets
    40004,  # fx, weights, 3 devices under budgets, replicas
    40006,  # fx, training, budgets
    40010,  # export, inference, budgets, replicas
    41024,  # export, inference, pinned; attention with is_causal (its mask is made on the host: host_anywhere)
]


def test_the_seeds_cover_each_way_of_splitting() -> None:
    ways = [scenario(seed) for seed in SEEDS]
    assert {w["trace"] for w in ways} == {"fx", "export"}
    assert {w["mode"] for w in ways} == {"training", "inference", "weights"}
    assert {w["devices"] for w in ways} == {2, 3}
    assert {w["pinned"] for w in ways} == {True, False}
    assert {w["replicate"] for w in ways} == {True, False}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_program_split_computes_what_it_computes_unsplit(seed: int) -> None:
    found = run_seed(seed)
    assert found["outcome"] == "equal", found
    assert len(found["used"]) > 1, found  # really split


def test_a_program_that_writes_its_input_writes_the_callers_tensor_as_eager_does() -> None:
    """Seed 43218 doubles a slice of its input through ``v0.view(16, -1)[..., 125:580].mul_(2.0)`` and reads it
    after: eager and the split each get their own copy of the inputs (one run's write must not reach the other's
    inputs, which once made this seed look wrong), and the split must leave the caller's copy as eager leaves its."""
    found = run_seed(43218)
    assert found["outcome"] == "equal", found  # outputs, and the input as each run left it ("input 0" otherwise)


def test_the_command_runs_each_seed_in_its_own_process_and_says_how_it_went(capsys: pytest.CaptureFixture[str]) -> None:
    import split_fuzz

    assert split_fuzz.main(40000, 40001) == 0  # python tests/split_fuzz.py 40000 40001
    assert capsys.readouterr().out.strip().splitlines()[-1] == "{'equal': 1}"
