"""Generated programs taken down the other routes to a split (:mod:`route_fuzz`), a fixed set of seeds.

A saved plan read back and applied, a split loaded from a checkpoint into a model built without weights, a split
that streams weights it cannot hold (offload), a pipeline of micro-batches, a split from a YAML spec file, a split
that keeps the weights where an Accelerate device map puts them, a float64 model built on meta split at float32
from a float32 checkpoint, a split called at another batch size, three optimizer steps on a split, and the command
line's plan, check and code: each seed must compute what the unsplit program computes (outputs, and in training
every gradient, or the weights after the steps; in float64, or at float32 against the float32 model), with no op
mixing devices.
``python tests/route_fuzz.py FIRST LAST`` runs any other range (400 seeds, 60000-60399, when it was written: no
output or gradient differed; one pipeline failed at its first run, and is refused when planned now).
"""

from __future__ import annotations

import pytest
from route_fuzz import ROUTES, ROUTES_MORE, ROUTES_THIRD, route_of, run_seed, scenario

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

THIRD = {  # of 62000-62299 (ROUTES_THIRD), each seed's outcome
    62016: "equal",  # resized: fx, training, batch 8 -> 2
    62013: "equal",  # resized: export (dynamic_shapes="batch"), inference, batch 12 -> 24
    62100: "equal",  # resized: export, training, batch 4 -> 2
    62005: "equal",  # train steps: export, AdamW, two backward passes a step (accumulate_grads=True)
    62044: "equal",  # train steps: fx, SGD with momentum, two Linear weights tied, 3 devices
    62011: "equal",  # train steps: fx, Adam
    62033: "equal",  # cli: fx, training, budgets, trace and mode as flags, code readable
    62081: "equal",  # cli: export, training, all in the spec, code --raw
    62027: "refused",  # cli: export, a pin of a module the program lacks: exit 2 naming it
}


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


def test_the_seeds_before_62000_keep_their_routes_and_choices() -> None:
    assert [route_of(seed) for seed in (61998, 61999, 62000, 62001, 62002)] == [
        "spec",
        "device_map",
        *ROUTES_THIRD[2:],
        *ROUTES_THIRD[:2],
    ]
    assert scenario(60999) == {  # as drawn before the third routes were added
        "route": "pipeline",
        "trace": "fx",
        "devices": 3,
        "mode": "training",
        "share": 0.728,
        "chunk_draw": 0.617,
        "recompute": "never",
    }
    assert scenario(61999) == {
        "route": "device_map",
        "trace": "export",
        "devices": 2,
        "mode": "training",
        "share": 0.953,
        "map": "plan",
        "via": "from_device_map_ints",
        "sized": False,
    }


def test_the_third_routes_seeds_cover_both_tracers_batch_changes_optimizers_and_a_refusal() -> None:
    ways = {seed: scenario(seed) for seed in THIRD}
    assert {(w["route"], w["trace"]) for w in ways.values()} == {
        (route, trace) for route in ROUTES_THIRD for trace in ("fx", "export")
    }
    assert {w["resize"] for w in ways.values() if w["route"] == "resized"} == {"down", "up"}
    steps = [w for w in ways.values() if w["route"] == "train_steps"]
    assert {w["optimizer"] for w in steps} == {"sgd_momentum", "adam", "adamw"}
    assert any(w["accumulate"] for w in steps) and any(w["tie"] for w in steps)
    commands = {seed: w for seed, w in ways.items() if w["route"] == "cli"}
    assert {THIRD[seed] for seed in commands} == {"equal", "refused"}
    assert {w["raw"] for w in commands.values()} == {True, False}  # code --raw, and readable
    assert {w["flags"] for w in commands.values()} == {True, False}  # budgets, trace and mode as flags, and in the spec


@pytest.mark.parametrize("seed", SEEDS)
def test_a_generated_program_reaches_its_split_by_each_route_and_computes_what_it_computes(seed: int) -> None:
    found = run_seed(seed)
    assert found["outcome"] == "equal", found
    assert len(found["used"]) > 1, found  # really split
    if found["route"] == "offload":
        assert found["streamed"] > 0, found  # weights really streamed
    if found["route"] == "device_map":
        assert len(found["holds"]) > 1, found  # the weights really on the map's devices


@pytest.mark.parametrize("seed", THIRD)
def test_a_generated_program_is_split_and_called_at_another_batch_trained_or_split_by_the_command_line(
    seed: int,
) -> None:
    found = run_seed(seed)
    assert found["outcome"] == THIRD[seed], found
    if found["outcome"] == "equal":
        assert len(found["used"]) > 1, found  # really split
    if found["route"] == "resized":
        assert found["batch"][0] != found["batch"][1], found
    if found["route"] == "train_steps" and found["tie"]:
        assert found["tied"], found  # two weights really tied
    if found["route"] == "cli" and found["outcome"] == "refused":
        assert found["exit"] == 2 and "pin['zz']: no module of the model matches 'zz'" in found["reason"], found


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
    assert lines[-11] == "{'equal': 1}" and lines[-10] == "saved_plan: {'equal': 1}" and lines[-7] == "pipeline: {}"
    assert lines[-6:-3] == ["spec: {}", "device_map: {}", "dtype_checkpoint: {}"]
    assert lines[-3:] == ["resized: {}", "train_steps: {}", "cli: {}"]
