"""Generated programs taken down the other routes to a split (:mod:`route_fuzz`), a fixed set of seeds.

A saved plan read back and applied, a split loaded from a checkpoint into a model built without weights, a split
that streams weights it cannot hold (offload), a pipeline of micro-batches, a split from a YAML spec file, a split
that keeps the weights where an Accelerate device map puts them, and a float64 model built on meta split at
float32 from a float32 checkpoint: each seed must compute what the unsplit program computes (outputs, and in
training every gradient; in float64, or at float32 against the float32 model), with no op mixing devices.
``python tests/route_fuzz.py FIRST LAST`` runs any other range (400 seeds, 60000-60399, when it was written: no
output or gradient differed; one pipeline failed at its first run, and is refused when planned now).
"""

from __future__ import annotations

import pytest
from route_fuzz import ROUTES, ROUTES_MORE, route_of, run_seed, scenario

pytestmark = pytest.mark.slow  # ~5 s a seed

SEEDS = [  # of 60000-60399, each route with each tracer and its own choices (scenario())
    60000,  # saved plan: fx, training, through JSON
    60036,  # saved plan: fx, weights, through YAML, replicas
    60112,  # saved plan: export, inference, 3 devices pinned, replicas
    60001,  # checkpoint: export, inference, safetensors, built on meta, fxsplit(checkpoint=)
    60073,  # checkpoint: fx, training, safetensors, empty_weights, apply(plan of the real model, checkpoint=)
    60077,  # checkpoint: fx, training, 3 devices, torch.save, built on meta, apply
    60010,  # offload: export, 3 devices pinned, from a safetensors checkpoint, disk, prefetch 1, streams
    60022,  # offload: fx, 3 devices pinned, the real model, disk, prefetch 1, streams
    60034,  # offload: fx, pinned, from a torch.save checkpoint, host and disk, streams
    60007,  # pipeline: fx, training, 3 devices, 2 micro-batches, each recomputed
    60027,  # pipeline: fx, training, 4 micro-batches
    60063,  # pipeline: export, training, recomputed but the last
    60075,  # pipeline: export, inference, 3 micro-batches
    # of 61000 and on (ROUTES_MORE)
    61008,  # spec: fx, training, each segment pinned, outputs on the first device, fxsplit.load_spec
    61020,  # spec: export, training, balanced, contiguous, budgets in bytes, the file's path
    61006,  # device map: fx, training, a segment on each device and the head, fxsplit(device_map=)
    61030,  # device map: export, weights, from a plan's placement by module, from_device_map(budgets sized)
    61010,  # dtype checkpoint: fx, training, safetensors, built on meta, fxsplit(dtype="float32", checkpoint=)
    61031,  # dtype checkpoint: export, inference, torch.save, empty_weights, apply(plan at float32, checkpoint=)
]


def test_the_seeds_cover_each_route_and_tracer() -> None:
    ways = [scenario(seed) for seed in SEEDS]
    assert {(w["route"], w["trace"]) for w in ways} == {
        (route, trace) for route in (*ROUTES, *ROUTES_MORE) for trace in ("fx", "export")
    }
    checkpoints = [w for w in ways if w["route"] == "checkpoint"]
    assert {w["via"] for w in checkpoints} == {"fxsplit", "apply"} and {w["file"] for w in checkpoints} == {
        "safetensors",
        "pt",
    }
    assert {w["mode"] for w in ways if w["route"] == "pipeline"} == {"training", "inference"}
    specs = [w for w in ways if w["route"] == "spec"]
    assert {w["via"] for w in specs} == {"path", "load_spec"} and any(w["pinned"] for w in specs)
    assert {w["via"] for w in ways if w["route"] == "device_map"} == {"fxsplit", "from_device_map"}
    casts = [w for w in ways if w["route"] == "dtype_checkpoint"]
    assert {w["via"] for w in casts} == {"fxsplit", "apply"} and {w["file"] for w in casts} == {"safetensors", "pt"}
    assert {w["build"] for w in casts} == {"meta_device", "empty_weights"}


def test_the_seeds_before_61000_keep_their_routes() -> None:
    assert [route_of(seed) for seed in range(60000, 60004)] == list(ROUTES)
    assert [route_of(seed) for seed in (60999, 61000, 61001, 61002)] == ["pipeline", *ROUTES_MORE[1:], ROUTES_MORE[0]]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_program_reaches_its_split_by_each_route_and_computes_what_it_computes(seed: int) -> None:
    found = run_seed(seed)
    assert found["outcome"] == "equal", found
    assert len(found["used"]) > 1, found  # really split
    if found["route"] == "offload":
        assert found["streamed"] > 0, found  # weights really streamed
    if found["route"] == "device_map":
        assert len(found["holds"]) > 1, found  # the weights really on the map's devices


def test_a_pipeline_that_cannot_run_on_one_micro_batch_is_refused_when_planned() -> None:
    """Seed 60203 views its batch by a constant (``view(12, -1)``): fx traced it without sizes, the split was made
    with a warning, and the first run failed inside a stage. The graph runs on the whole example batch's fakes and
    not on one micro-batch's, so it is refused when planned, as torch.export refuses it."""
    found = run_seed(60203)
    assert found["outcome"] == "refused", found
    assert found["error"].startswith("TraceError: with pipeline chunks=4 the model is traced on one micro-batch")


def test_the_command_runs_each_seed_in_its_own_process_and_tallies_each_route(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import route_fuzz

    assert route_fuzz.main(60000, 60001) == 0  # python tests/route_fuzz.py 60000 60001
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-8] == "{'equal': 1}" and lines[-7] == "saved_plan: {'equal': 1}" and lines[-4] == "pipeline: {}"
    assert lines[-3:] == ["spec: {}", "device_map: {}", "dtype_checkpoint: {}"]
