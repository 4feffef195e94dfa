"""Partition specs: strict validation (every problem, with path and line), and specs driving plans."""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.factory import load_model
from fxsplit.spec import Headroom, SpecProblems, load_spec

ROOT = Path(__file__).resolve().parents[1]
TinyLM = load_model(f"{ROOT / 'examples' / 'models.py'}:factory").model.__class__

# (spec text, [(line, path, message fragment), ...]): every expected problem, and nothing else.
BAD_SPECS = [
    pytest.param(
        "devices: {cpu:0: 1GiB}\nobjectiv: balanced",
        [(2, "objectiv", "unknown key; did you mean 'objective'?")],
        id="unknown-key",
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB}\npins: {a: cpu:0}", [(2, "pins", "did you mean 'pin'?")], id="unknown-key-pins"
    ),
    pytest.param(
        "devices:\n  cpu:0: 1GiB\n  cpu:1: {budget: 1GiB, reserv: 1%}",
        [(3, "devices['cpu:1']['reserv']", "did you mean 'reserve'?")],
        id="unknown-device-key",
    ),
    pytest.param(
        "devices:\n  cpu:0: 10 GiBs",
        [(2, "devices['cpu:0']", "budget '10 GiBs' has unknown unit 'GiBs'")],
        id="malformed-size",
    ),
    pytest.param("devices:\n  cpu:0: -3", [(2, "devices['cpu:0']", "must not be negative")], id="negative-size"),
    pytest.param(
        "devices:\n  gpu:1: 1GiB",
        [(2, "devices['gpu:1']", "unknown device 'gpu:1'; did you mean 'cuda:1'?")],
        id="unknown-device",
    ),
    pytest.param(
        "devices:\n  tpu:0: 1GiB", [(2, "devices['tpu:0']", "unknown device 'tpu:0'")], id="unknown-device-type"
    ),
    pytest.param("devices:\n  meta: 1GiB", [(2, "devices['meta']", "'meta' holds no data")], id="meta-device"),
    pytest.param("devices: [cpu:0, cpu:1]", [(1, "devices", "must map each device to its budget")], id="devices-list"),
    pytest.param(
        "devices:\n  cpu:0: 1GiB\n  0: 1GiB\n  cuda:0: 2GiB",
        [(4, "devices['cuda:0']", "names device 'cuda:0' a second time")],
        id="same-device-twice",
    ),
    pytest.param(
        "devices:\n  cpu:0: 1GiB\n  cpu:0: 2GiB", [(3, "devices['cpu:0']", "duplicate key")], id="duplicate-key"
    ),
    pytest.param("devices:\n  cpu:1: {reserve: 10%}", [(2, "devices['cpu:1']", "needs a budget")], id="no-budget"),
    pytest.param(
        "devices:\n  cpu:1: {budget: 1GiB, reserve: 1GiB}",
        [(2, "devices['cpu:1']['reserve']", "leaves nothing of the budget")],
        id="reserve-all",
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB}\nreserve: 120%",
        [(2, "reserve", "not a percentage of the budget from 0% to below 100%")],
        id="reserve-percent",
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB}\npin:\n  lm_head: cpu:3",
        [(3, "pin['lm_head']", "pins to 'cpu:3', which is not under devices (cpu:0)")],
        id="pin-no-budget",
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB, cpu:1: 1 GiBs}\npin:\n  lm_head: cpu:1",
        [(1, "devices['cpu:1']", "has unknown unit 'GiBs'")],  # the pin's device is listed: said once, there
        id="pin-to-a-device-with-a-bad-budget",
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB}\npin: [lm_head]", [(2, "pin", "must map module paths or globs")], id="pin-list"
    ),
    pytest.param(
        "devices: {cpu:0: 1GiB}\npin:\n  0.5: cpu:0",
        [(3, "pin[0.5]", "quote paths that look like numbers")],
        id="pin-float-key",
    ),
    pytest.param("together: lm_head", [(1, "together", "must be a list of groups")], id="together-string"),
    pytest.param(
        "together:\n  - [a, 3]\n  - []",
        [
            (2, "together[0][1]", "must be a module path or glob, as a string (got int 3)"),
            (3, "together[1]", "an empty group"),
        ],
        id="together-items",
    ),
    pytest.param(
        "leaf_modules: Block",
        [(1, "leaf_modules", "must be a list, each item a module path or class name")],
        id="leaf-string",
    ),
    pytest.param(
        "trace: exprt",
        [(1, "trace", "must be one of auto, fx, export (got 'exprt'); did you mean 'export'?")],
        id="trace",
    ),
    pytest.param(
        "objective: 3",
        [(1, "objective", "must be one of min_transfer, balanced, throughput, latency (got 3)")],
        id="objective",
    ),
    pytest.param("dtype: bf17", [(1, "dtype", "did you mean 'bf16'?")], id="dtype"),
    pytest.param("output_device: gpu", [(1, "output_device", "did you mean 'cuda'?")], id="output-device"),
    pytest.param("mode: trainig", [(1, "mode", "did you mean 'training'?")], id="mode"),
    pytest.param("optimizer: adam", [(1, "optimizer", "only counts with mode: training")], id="optimizer-no-training"),
    pytest.param("mode: training\noptimizer: adma", [(2, "optimizer", "did you mean 'adam'?")], id="optimizer-name"),
    pytest.param("mode: training\noptimizer: -4", [(2, "optimizer", "must be 0 or more")], id="optimizer-negative"),
    pytest.param(
        "mode: training\noptimizer: [adam]", [(2, "optimizer", "or bytes per parameter element")], id="optimizer-type"
    ),
    pytest.param("dynamic_shapes: batches", [(1, "dynamic_shapes", "did you mean 'batch'?")], id="dynamic-shapes"),
    pytest.param("- devices\n- pin", [(1, "<top>", "a spec must be a mapping")], id="not-a-mapping"),
    pytest.param("", [(None, "<top>", "(it is empty)")], id="empty"),
    pytest.param("devices: {cpu:0: 1GiB", [(1, "<top>", "not valid YAML")], id="bad-yaml"),
    pytest.param(
        "devices:\n  cuda:0: 10 GiBs\n  gpu:1: 1GiB\npinn: {a: cuda:0}\ntrace: fxx\ndtype: 16\n",
        [
            (2, "devices['cuda:0']", "unknown unit 'GiBs'"),
            (3, "devices['gpu:1']", "did you mean 'cuda:1'?"),
            (4, "pinn", "did you mean 'pin'?"),
            (5, "trace", "did you mean 'fx'?"),
            (6, "dtype", "must be one of"),
        ],
        id="several-at-once",
    ),
]


@pytest.mark.parametrize(("text", "expected"), BAD_SPECS)
def test_bad_specs_report_every_problem_with_path_and_line(text: str, expected: list) -> None:
    with pytest.raises(SpecProblems) as caught:
        load_spec(text)
    error = caught.value
    assert isinstance(error, fxsplit.SpecError) and isinstance(error, ValueError)
    rendered = [p.render("<spec>") for p in error.problems]
    assert len(error.problems) == len(expected), rendered
    for problem, (line, path, fragment) in zip(error.problems, expected, strict=True):
        assert problem.line == line, rendered
        assert problem.render("x").split(": ", 2)[1] == path, rendered
        assert fragment in problem.message, rendered
        where = f"<spec>:{line}: {path}: " if line else f"<spec>: {path}: "
        assert where in str(error)


def test_problems_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("devices:\n  cuda:0: 20GiB\n  cuda:1: 10 GiBs\npinn: {}\n")
    with pytest.raises(fxsplit.SpecError) as caught:
        fxsplit.load_spec(str(path))
    text = str(caught.value)
    assert text.startswith(f"{path}: 2 problems:")
    assert f"{path}:3: devices['cuda:1']: budget '10 GiBs' has unknown unit" in text
    assert f"{path}:4: pinn: unknown key; did you mean 'pin'?" in text


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(fxsplit.SpecError, match="cannot read spec file"):
        load_spec(str(tmp_path / "nope.yaml"))


def test_a_spec_cannot_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"devices: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(SpecProblems, match="could not determine a constructor .* safe loader: no Python objects"):
        load_spec(text)
    assert not marker.exists()


def test_good_spec_fields() -> None:
    spec = load_spec("""
devices:
  0: 20GiB
  cuda:1: {budget: 20GB, reserve: 1GiB}
  cpu: 1.5GiB
reserve: 10%
pin: {"0": cuda:0, "decoder.*": 1}
together: [[model.norm, lm_head]]
leaf_modules: [MyBlock]
trace: fx
objective: balanced
output_device: cpu
dtype: half
""")
    assert list(spec.devices.items()) == [("cuda:0", 20 * 2**30), ("cuda:1", 20 * 10**9), ("cpu", 3 * 2**29)]
    assert spec.reserve_for("cuda:1") == Headroom(nbytes=2**30)
    assert spec.reserve_for("cuda:0").of(1000) == 100
    assert spec.pins == {"0": "cuda:0", "decoder.*": "cuda:1"}
    assert spec.together == (("model.norm", "lm_head"),)
    assert (spec.trace, spec.objective, spec.output_device, spec.dtype) == ("fx", "balanced", "cpu", "float16")
    assert spec.locate(("pin", "decoder.*")) == "<spec>:7: pin['decoder.*']"


@pytest.mark.parametrize(
    "path", sorted(glob.glob(str(ROOT / "specs" / "*.yaml"))) + [str(ROOT / "examples" / "spec_example.yaml")]
)
def test_shipped_specs_load_and_plan(path: str) -> None:
    spec = fxsplit.load_spec(path)
    assert spec.devices
    with torch.device("meta"):
        model = TinyLM(vocab=1000, width=64, depth=4)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    plan = fxsplit.plan(model, spec=path, example_inputs=(ids,), trace="fx")
    assert plan.devices == tuple(spec.devices)
    assert plan.reserved == {d: spec.reserve_for(d).of(b) for d, b in spec.devices.items()} or not (
        spec.reserve or spec.default_reserve
    )
    for pattern, device in spec.pins.items():
        assert plan.param_devices[f"{pattern}.weight"] in (device, plan.param_devices["model.embed_tokens.weight"])


def test_readme_documents_every_field() -> None:
    text = (ROOT / "specs" / "README.md").read_text()
    from fxsplit.spec import DEVICE_KEYS, OFFLOAD_KEYS, SPEC_KEYS

    for key in (*SPEC_KEYS, *DEVICE_KEYS, *OFFLOAD_KEYS):
        assert f"`{key}`" in text, key


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


LAYER = 16 * 16 * 4 + 16 * 4  # bytes of one Linear(16, 16)
X = (torch.randn(3, 16),)


def plan_with(text: str, **options: object) -> fxsplit.Plan:
    """Plan ``Chain`` under a spec whose budgets count its weights only (a spec has no ``mode``: the keyword)."""
    return fxsplit.plan(Chain(), spec=text, example_inputs=X, trace="fx", mode="weights", **options)


def test_spec_drives_the_split_and_outputs_match() -> None:
    model = Chain()
    expected = model(*X)
    spec = f"devices: {{cpu:0: {3 * LAYER}, cpu:1: {3 * LAYER}}}\npin: {{head: cpu:1}}\ntrace: fx\n"
    gm = fxsplit.fxsplit(model, spec=spec, example_inputs=X, mode="weights")
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["head.weight"] == "cpu:1" and plan.param_devices["embed.weight"] == "cpu:0"
    torch.testing.assert_close(gm(*X), expected)


def test_keywords_override_the_spec() -> None:
    spec = f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {6 * LAYER}}}\nobjective: balanced\n"
    assert plan_with(spec).objective == "balanced"
    plan = plan_with(spec, objective="min_transfer", budgets={"cpu:2": 6 * LAYER})
    assert plan.objective == "min_transfer" and plan.devices == ("cpu:2",)


def test_budgets_are_required_somewhere() -> None:
    with pytest.raises(fxsplit.SpecError, match="no budgets"):
        plan_with("objective: balanced")
    with pytest.raises(fxsplit.SpecError, match="unknown option 'spek'; did you mean 'spec'"):
        fxsplit.plan(Chain(), {"cpu:0": "1MiB"}, spek="x.yaml")


def test_reserve_is_held_back_and_recorded() -> None:
    fits = plan_with(f"devices: {{cpu:0: {6 * LAYER}}}")
    assert fits.reserved == {}
    with pytest.raises(fxsplit.BudgetError, match="budget"):
        plan_with(f"devices: {{cpu:0: {6 * LAYER}}}\nreserve: 10%")
    plan = plan_with(f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {{budget: {6 * LAYER}, reserve: 100}}}}\nreserve: 10%")
    assert plan.reserved == {"cpu:0": int(0.6 * LAYER), "cpu:1": 100}
    assert plan.budgets == {"cpu:0": 6 * LAYER, "cpu:1": 6 * LAYER}
    assert all(plan.device_bytes[d] <= plan.budgets[d] - plan.reserved[d] for d in plan.devices)
    assert "reserve" in str(plan).splitlines()[0]
    budgets = {"cpu:0": 6 * LAYER, "cpu:1": 6 * LAYER}
    keyword = fxsplit.plan(Chain(), budgets, example_inputs=X, reserve={"cpu:1": "1KiB"}, mode="weights")
    assert keyword.reserved == {"cpu:0": 0, "cpu:1": 1024}


def test_planning_dtype_scales_weights_and_activations() -> None:
    full = plan_with(f"devices: {{cpu:0: {3 * LAYER}, cpu:1: {3 * LAYER}}}\n")
    half = plan_with(f"devices: {{cpu:0: {3 * LAYER // 2}, cpu:1: {3 * LAYER // 2}}}\ndtype: bf16\n")
    assert full.placement == half.placement and full.cuts
    assert half.dtype == "bfloat16" and full.dtype is None
    assert sum(half.device_bytes.values()) * 2 == sum(full.device_bytes.values())
    assert [c.nbytes for c in full.cuts] == [2 * c.nbytes for c in half.cuts if c.nbytes]
    assert "planned as bfloat16" in str(half)


def test_together_keeps_modules_on_one_device() -> None:
    text = f"devices: {{cpu:0: {4 * LAYER}, cpu:1: {4 * LAYER}}}\n"
    apart = plan_with(text)
    assert apart.param_devices["layers.1.weight"] != apart.param_devices["layers.2.weight"]
    group = plan_with(text + "together: [[layers.1, layers.2]]\n")
    assert group.param_devices["layers.1.weight"] == group.param_devices["layers.2.weight"]


def test_pin_naming_a_missing_module_suggests_close_names() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:
        plan_with(f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {6 * LAYER}}}\npin:\n  haed: cpu:1\n  layer.*: cpu:1\n")
    text = str(caught.value)
    assert "2 problems" in text
    assert "<spec>:3: pin['haed']: no module of the model matches 'haed'; did you mean 'head'?" in text
    assert "<spec>:4: pin['layer.*']: no module of the model matches 'layer.*'; did you mean 'layers.*'?" in text


def test_conflicting_pins_are_reported() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:
        plan_with(f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {6 * LAYER}}}\npin:\n  layers.*: cpu:0\n  layers.2: cpu:1\n")
    text = str(caught.value)
    assert "<spec>:4: pin['layers.2']: conflicts with <spec>:3: pin['layers.*']" in text
    assert "'cpu:1' and 'cpu:0'" in text


def test_pins_against_the_device_order_are_reported() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:
        plan_with(f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {6 * LAYER}}}\npin:\n  embed: cpu:1\n  head: cpu:0\n")
    message = str(caught.value)
    assert "<spec>:4: pin['head']: pins op 'head' (in 'head') to 'cpu:0', but it runs after op 'embed'" in message


def test_together_group_pinned_to_two_devices() -> None:
    text = (
        f"devices: {{cpu:0: {6 * LAYER}, cpu:1: {6 * LAYER}}}\npin: {{embed: cpu:0, head: cpu:1}}\n"
        "together:\n  - [embed, head]\n  - [nothing]\n"
    )
    with pytest.raises(fxsplit.SpecError) as caught:
        plan_with(text)
    text = str(caught.value)
    assert (
        "<spec>:4: together[0]: its ops must share a device, but pins 'embed', 'head' put some of them on cpu:0 "
        "and cpu:1" in text
    )
    assert "<spec>:5: together[1][0]: no module of the model matches 'nothing'" in text


def test_pins_that_make_budgets_infeasible_name_the_pin() -> None:
    text = f"devices: {{cpu:0: {3 * LAYER}, cpu:1: {3 * LAYER}}}\ncontiguous: true\npin:\n  embed: cpu:1\n"
    folded = plan_with(text.replace("contiguous: true", "contiguous: false"))  # out of order it fits
    assert folded.placement["embed"] == "cpu:1" and folded.placement["head"] == "cpu:0"  # runs cpu:1 -> cpu:0
    with pytest.raises(fxsplit.BudgetError) as caught:
        plan_with(text)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "it fits without <spec>:4: pin['embed'] -> 'cpu:1'" in message
    assert (
        "Everything after 'embed' (pinned to 'cpu:1') needs 5.31 KiB, but 'cpu:1' and the devices after it have "
        "2.12 KiB left" in message
    )
    with pytest.raises(fxsplit.BudgetError, match=r"it fits without pins\['embed'\] -> 'cpu:1'"):
        fxsplit.plan(
            Chain(),
            {"cpu:0": 3 * LAYER, "cpu:1": 3 * LAYER},
            example_inputs=X,
            pins={"embed": "cpu:1"},
            contiguous=True,
            mode="weights",
        )


def test_together_that_makes_budgets_infeasible_is_named() -> None:
    text = f"devices: {{cpu:0: {3 * LAYER}, cpu:1: {3 * LAYER}}}\ntogether: [[embed, layers.2]]\n"
    with pytest.raises(fxsplit.BudgetError, match=r"it fits without <spec>:2: together\[0\]"):
        plan_with(text)


def test_leaf_modules_by_class_name_or_path() -> None:
    text = f"devices: {{cpu:0: {6 * LAYER}}}\nleaf_modules: [Linear]\n"
    assert plan_with(text).leaf_modules == ("Linear",)
    with pytest.raises(fxsplit.SpecError, match=r"<spec>:2: leaf_modules\[0\]: 'Linaer' is neither .*mean 'Linear'"):
        plan_with(f"devices: {{cpu:0: {6 * LAYER}}}\nleaf_modules: [Linaer]\n")


def test_spec_objects_and_mappings_are_accepted() -> None:
    spec = load_spec({"devices": {"cpu:0": 6 * LAYER}})
    assert fxsplit.load_spec(spec) is spec
    assert plan_with(spec).devices == ("cpu:0",)
    assert os.fspath(ROOT)  # path-like sources go through load_spec(Path)
    assert load_spec(ROOT / "specs" / "two_gpus.yaml").devices["cuda:1"] == 24 * 2**30


@pytest.mark.parametrize("together", ["embed", ["embed", "head"], [[]], [["embed", 3]]])
def test_malformed_together_keyword(together: object) -> None:
    with pytest.raises(fxsplit.SpecError, match="together"):
        fxsplit.plan(Chain(), {"cpu:0": "1MiB"}, example_inputs=X, together=together)


def test_spec_pipeline_key_becomes_the_pipeline_option() -> None:
    spec = fxsplit.load_spec("devices: {cpu:0: 1MiB, cpu:1: 1MiB}\npipeline: {chunks: 2}\n")
    assert spec.pipeline == fxsplit.PipelineConfig(chunks=2)
    assert spec.options()["pipeline"] == fxsplit.PipelineConfig(chunks=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    piped = fxsplit.fxsplit(model, spec=spec, example_inputs=(x,))
    assert isinstance(piped, fxsplit.Pipeline)
    torch.testing.assert_close(piped(x), reference(x))


def test_spec_pipeline_key_is_validated_with_its_line() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"<spec>:2: pipeline: .*chunks"):
        fxsplit.load_spec("devices: {cpu:0: 1MiB}\npipeline: {chunk: 2}\n")
    with pytest.raises(fxsplit.SpecError) as raised:  # every problem of the block at once
        fxsplit.load_spec(
            "devices: {cpu:0: 1MiB}\npipeline: {chunks: 2, checkpoint: sometimes, batch_stats: maybe, x: 1}\n"
        )
    assert all(f in str(raised.value) for f in ("unknown pipeline option(s) 'x'", "'sometimes'", "'maybe'")), (
        raised.value
    )


def test_spec_mode_and_optimizer_set_what_the_budgets_hold() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    training = fxsplit.load_spec("devices: {cpu:0: 1MiB, cpu:1: 1MiB}\nmode: training\noptimizer: sgd_momentum\n")
    assert training.options() == {"mode": "training", "optimizer": "sgd_momentum"}
    memory = fxsplit.plan(model, spec=training, example_inputs=(x,)).memory
    params = sum(row["params"] for row in memory.values())
    assert sum(row["grads"] for row in memory.values()) == params  # one gradient per parameter
    assert sum(row["optimizer"] for row in memory.values()) == params  # one momentum buffer each
    weights = fxsplit.load_spec("devices: {cpu:0: 1MiB, cpu:1: 1MiB}\nmode: weights\n")
    memory = fxsplit.plan(model, spec=weights, example_inputs=(x,)).memory
    assert all(row["grads"] == row["optimizer"] == 0 and "activations_peak" not in row for row in memory.values())
    # an explicit keyword overrides the spec
    memory = fxsplit.plan(model, spec=training, example_inputs=(x,), optimizer="adam").memory
    assert sum(row["optimizer"] for row in memory.values()) == 2 * params
