"""Accelerate device maps: weights where the map says, ops where they copy least, the split equal to the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import Tied, Unused, assert_same_grads, assert_same_structure, default_loss

import fxsplit
from fxsplit.check import DeviceChecker, verify_plan, verify_split
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.planning.devicemap import place_ops, read_device_map


class Shared(nn.Module):
    """T5's shape: ``shared`` holds the embedding, but the graph reads it only through the tied ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(40, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(F.embedding(ids, self.head.weight)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


class Straddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.enc = Encoder()
        self.post = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.enc(self.pre(x)))


def split_by_map(model: nn.Module, device_map: dict[str, Any], inputs: tuple[Any, ...], trace: str, **options: Any):
    """Plan from the map, apply, and compare outputs and gradients with an unsplit copy."""
    reference = copy.deepcopy(model)
    plan = fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace=trace, **options)
    assert plan.param_devices == read_device_map(model, device_map, options.get("devices"))
    verify_plan(plan, model=model)
    gm = fxsplit.apply(model, plan, example_inputs=inputs)
    verify_split(gm)
    with DeviceChecker(plan, gm, model):
        out = gm(*inputs)
    expected = reference(*inputs)
    assert_same_structure(out, expected)
    default_loss(out).backward()
    default_loss(expected).backward()
    assert_same_grads(model, reference)
    return plan


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_tied_module_that_runs_no_op(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"shared": "cpu:0", "head": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1"}
    plan = split_by_map(Shared(), device_map, (torch.randint(0, 40, (2, 5)),), trace)
    assert plan.param_devices["shared.weight"] == plan.param_devices["head.weight"] == "cpu:0"
    assert plan.devices == ("cpu:0", "cpu:1")


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_tied_language_model(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"emb": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1", "body.4": "cpu:1", "head": "cpu:0"}
    plan = split_by_map(Tied(), device_map, (torch.randint(0, 40, (2, 5)),), trace)
    assert not [c for c in plan.cuts if c.kind == "parameter"]  # the head runs beside the embedding it reads


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_module_straddling_devices(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"pre": "cpu:0", "enc.layer.weight": "cpu:0", "enc.layer.bias": "cpu:1", "post": "cpu:1"}
    plan = split_by_map(Straddle(), device_map, (torch.randn(3, 16),), trace)
    assert plan.param_devices["enc.layer.bias"] == "cpu:1"
    assert [(c.producer, c.kind) for c in plan.cuts if c.kind == "parameter"] == [("enc.layer.bias", "parameter")]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_unused_submodule(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"a": "cpu:0", "b": "cpu:1", "spare": "cpu:1", "idle": "cpu:0"}
    plan = split_by_map(Unused(), device_map, (torch.randn(2, 8),), trace)
    assert plan.param_devices["spare.weight"] == "cpu:1" and plan.param_devices["idle"] == "cpu:0"


def test_whole_model_key_and_longest_match() -> None:
    model = Straddle()
    homes = read_device_map(model, {"": "cpu:1", "enc": "cpu:0", "enc.layer.bias": 1}, {1: "cpu:1"})
    assert homes == {
        "pre.weight": "cpu:1",
        "pre.bias": "cpu:1",
        "enc.layer.weight": "cpu:0",
        "enc.layer.bias": "cpu:1",
        "post.weight": "cpu:1",
        "post.bias": "cpu:1",
    }
    assert read_device_map(model, {"": 0}) == dict.fromkeys(homes, "cuda:0")


def test_errors_list_every_problem() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:
        read_device_map(Straddle(), {"pre": "cpu:0", "enc.layr": "cpu:1"})
    message = str(caught.value)
    assert "key 'enc.layr' names no module" in message and "did you mean 'enc.layer'" in message
    assert "no key covers 4 tensor(s): 'enc.layer.weight', 'enc.layer.bias', 'post.weight', 'post.bias'" in message


def test_offload_is_refused() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"'post': 'disk' offloads, which fxsplit does not support yet"):
        fxsplit.from_device_map(Straddle(), {"": "cpu:0", "post": "disk"})


def test_tied_names_must_agree() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"'shared.weight' and 'head.weight' are one tensor \(tied\)"):
        read_device_map(Shared(), {"": "cpu:0", "head": "cpu:1"})


def test_budgets_must_hold_the_map() -> None:
    device_map = {"pre": "cpu:0", "enc": "cpu:0", "post": "cpu:1"}
    with pytest.raises(fxsplit.BudgetError, match=r"'cpu:0'"):
        fxsplit.from_device_map(Straddle(), device_map, {"cpu:0": 1000, "cpu:1": "1MiB"}, mode="weights")
    with pytest.raises(fxsplit.SpecError, match=r"the budgets do not name"):
        fxsplit.from_device_map(Straddle(), device_map, {"cpu:0": "1MiB"})
    with pytest.raises(fxsplit.SpecError, match=r"does not take pins"):
        fxsplit.from_device_map(Straddle(), device_map, pins={"pre": "cpu:0"})


def test_given_budgets_keep_their_order_and_devices() -> None:
    budgets = {"cpu:0": "1MiB", "cpu:1": "1MiB", "cpu:2": "1MiB"}
    plan = fxsplit.from_device_map(Straddle(), {"": "cpu:1"}, budgets, example_inputs=(torch.randn(2, 16),))
    assert plan.devices == ("cpu:0", "cpu:1", "cpu:2")
    assert set(plan.placement.values()) == {"cpu:1"} and plan.cuts == ()


def test_place_ops_copies_least_around_pins() -> None:
    chain = PartitionProblem(
        ("a", "b", "c", "d"),
        (Value("a", 100, 0, (1,)), Value("b", 1, 1, (2,)), Value("c", 100, 2, (3,))),
    )
    assert place_ops(chain, {0: 0, 3: 1}, 2).op_devices == (0, 0, 1, 1)
    assert place_ops(chain, {}, 2).op_devices == (0, 0, 0, 0)


def test_accelerate_map_of_a_transformers_model() -> None:
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.config.use_cache = False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = accelerate.infer_auto_device_map(
        model, max_memory={0: size // 2, 1: size * 2}, no_split_module_classes=["GPT2Block"]
    )
    assert set(device_map.values()) == {0, 1}
    ids = torch.randint(0, 100, (2, 8))
    reference = copy.deepcopy(model)
    plan = fxsplit.from_device_map(
        model, device_map, example_inputs=(ids,), devices={0: "cpu:0", 1: "cpu:1"}, trace="export"
    )
    own = fxsplit.plan(copy.deepcopy(model), plan.budgets, example_inputs=(ids,), trace="export")
    assert plan.transfer_bytes >= own.transfer_bytes
    gm = fxsplit.apply(model, plan, example_inputs=(ids,))
    torch.testing.assert_close(gm(ids).logits, reference(ids).logits)


def test_plan_saves_and_checks_like_any_plan() -> None:
    torch.manual_seed(0)
    model, inputs = Tied(), (torch.randint(0, 40, (2, 5)),)
    device_map = {"emb": "cpu:0", "body": "cpu:1", "head": "cpu:0"}
    plan = fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace="export")
    assert fxsplit.Plan.from_yaml(plan.to_yaml()) == plan
    assert fxsplit.check_plan(model, plan, example_inputs=inputs).notes == ()
    assert plan == fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace="export")


def split_by_pins(model: nn.Module, pins: dict[str, Any], inputs: tuple[Any, ...], trace: str) -> fxsplit.Plan:
    """``fxsplit.fxsplit(pins=<device map>)``: warned, the map's placement exactly, outputs and grads unchanged."""
    reference = copy.deepcopy(model)
    with pytest.warns(fxsplit.FxsplitWarning, match=r"pins read as a device map: as op pins they fail"):
        gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=inputs, pins=pins, trace=trace)
    plan = gm.meta["fxsplit_plan"]
    homes = read_device_map(reference, pins)
    assert {name: plan.param_devices[name] for name in homes} == homes
    verify_split(gm)
    out, expected = gm(*inputs), reference(*inputs)
    assert_same_structure(out, expected)
    default_loss(out).backward()
    default_loss(expected).backward()
    assert_same_grads(model, reference)
    return plan


BUDGETS = {"cpu:0": "4MiB", "cpu:1": "4MiB"}


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_pins_naming_a_module_that_runs_no_op_are_a_device_map(trace: str) -> None:
    torch.manual_seed(0)
    pins = {"shared": "cpu:0", "head": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1"}
    plan = split_by_pins(Shared(), pins, (torch.randint(0, 40, (2, 5)),), trace)
    assert plan.param_devices["body.2.weight"] == "cpu:1" and plan.param_devices["shared.weight"] == "cpu:0"
    pins = {"a": "cpu:0", "b": "cpu:1", "spare": "cpu:1", "idle": "cpu:0"}
    plan = split_by_pins(Unused(), pins, (torch.randn(2, 8),), trace)
    assert plan.param_devices["spare.weight"] == "cpu:1" and plan.param_devices["idle"] == "cpu:0"


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_pins_straddling_devices_are_a_device_map(trace: str) -> None:
    torch.manual_seed(0)
    pins = {"": "cpu:0", "enc.layer.bias": "cpu:1", "post": "cpu:1"}
    plan = split_by_pins(Straddle(), pins, (torch.randn(3, 16),), trace)
    assert plan.param_devices["enc.layer.weight"] == "cpu:0" and plan.param_devices["enc.layer.bias"] == "cpu:1"


def test_valid_op_pins_keep_their_meaning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        plan = fxsplit.plan(Straddle(), BUDGETS, example_inputs=(torch.randn(3, 16),), pins={"enc": "cpu:1"})
    assert {plan.placement[n] for n, d in plan.placement.items() if n.startswith("enc")} <= {"cpu:1"}
    assert plan.param_devices["enc.layer.weight"] == "cpu:1"


def test_pins_that_are_neither_name_both_readings() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:  # a module that runs no op, and 'post' not covered
        fxsplit.plan(Shared(), BUDGETS, example_inputs=(torch.randint(0, 40, (2, 5)),), pins={"shared": "cpu:0"})
    message = str(caught.value)
    assert "module 'shared' runs no op of the traced graph" in message
    assert "read as a device map (where the weights live) instead, the pins fail too" in message
    assert "no key covers 4 tensor(s): 'body.0.weight', 'body.0.bias', 'body.2.weight', 'body.2.bias';" in message
    with pytest.raises(fxsplit.SpecError, match=r"no module of the model matches 'enc.layr'; did you mean 'enc.layer'"):
        fxsplit.plan(Straddle(), BUDGETS, pins={"": "cpu:0", "enc.layr": "cpu:1"})  # a typo: never a device map


def test_device_map_errors_name_the_key_and_the_device() -> None:
    inputs = (torch.randn(3, 16),)
    unknown = r"device_map\['enc.layr'\]: key 'enc.layr' names no module.*'enc.layer'"
    with pytest.raises(fxsplit.SpecError, match=unknown):
        fxsplit.plan(Straddle(), BUDGETS, example_inputs=inputs, device_map={"": "cpu:0", "enc.layr": "cpu:1"})
    with pytest.raises(fxsplit.SpecError, match=r"does not combine with together"):
        fxsplit.plan(Straddle(), BUDGETS, device_map={"": "cpu:0"}, together=[["pre", "post"]])
    with pytest.raises(fxsplit.BudgetError, match=r"'cpu:1' holds .* but may hold 1.00 KiB: over by "):
        fxsplit.plan(Straddle(), {"cpu:0": "1MiB", "cpu:1": "1KiB"}, example_inputs=inputs, device_map={"": "cpu:1"})


def _rule_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans from device maps with the readers of weights pinned where most of their bytes are (the simple rule)."""
    from fxsplit.partition.refine import device_loads
    from fxsplit.partition.result import Partition, transfer_bytes
    from fxsplit.planning import weightmap

    def start(problem: PartitionProblem, homes: Any, placed: Any, n: int, keep: Any = None) -> Partition:
        return Partition(tuple(placed), transfer_bytes(problem, placed), tuple(device_loads(problem, placed, n)))

    monkeypatch.setattr(weightmap, "free_readers", start)


def test_free_readers_copy_a_small_weight_instead_of_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import pathlib

    from examples.models import factory

    model, inputs = factory()
    root = pathlib.Path(__file__).resolve().parents[1]
    device_map = json.loads((root / "examples" / "tinylm_device_map.json").read_text())
    plan = fxsplit.plan(model, BUDGETS, example_inputs=inputs, device_map=device_map)
    _rule_only(monkeypatch)
    rule = fxsplit.plan(model, BUDGETS, example_inputs=inputs, device_map=device_map)
    assert plan.param_devices == rule.param_devices
    assert (plan.transfer_bytes, rule.transfer_bytes) == (16896, 24576)
    assert ("model.layers.4.norm.weight", "parameter") in [(c.producer, c.kind) for c in plan.cuts]


@pytest.mark.parametrize(
    ("make", "device_map", "inputs"),
    [
        (Shared, {"shared": "cpu:0", "head": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1"}, "ids"),
        (Tied, {"emb": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1", "body.4": "cpu:1", "head": "cpu:0"}, "ids"),
        (Straddle, {"pre": "cpu:0", "enc.layer.weight": "cpu:0", "enc.layer.bias": "cpu:1", "post": "cpu:1"}, "x"),
        (Unused, {"a": "cpu:0", "b": "cpu:1", "spare": "cpu:1", "idle": "cpu:0"}, "x8"),
    ],
)
def test_never_more_bytes_than_the_simple_rule(
    monkeypatch: pytest.MonkeyPatch, make: Any, device_map: dict[str, str], inputs: str
) -> None:
    torch.manual_seed(0)
    example = {"ids": torch.randint(0, 40, (2, 5)), "x": torch.randn(3, 16), "x8": torch.randn(2, 8)}[inputs]
    plan = fxsplit.plan(make(), BUDGETS, example_inputs=(example,), device_map=device_map)
    _rule_only(monkeypatch)
    rule = fxsplit.plan(make(), BUDGETS, example_inputs=(example,), device_map=device_map)
    assert plan.transfer_bytes <= rule.transfer_bytes


def test_accelerate_map_passed_as_pins() -> None:
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = accelerate.infer_auto_device_map(model, max_memory={0: size // 2, 1: size * 2})  # splits blocks
    assert set(device_map.values()) == {0, 1}
    ids = torch.randint(0, 100, (2, 8))
    with pytest.warns(fxsplit.FxsplitWarning, match=r"pins read as a device map"):  # ints are cuda:N, as budgets'
        on_gpus = fxsplit.plan(model, {0: "4MiB", 1: "4MiB"}, example_inputs=(ids,), pins=dict(device_map))
    homes = read_device_map(model, device_map)
    assert {name: on_gpus.param_devices[name] for name in homes} == homes
    on_cpus = {key: f"cpu:{value}" for key, value in device_map.items()}
    plan = split_by_pins(model, on_cpus, (ids,), "export")
    assert plan.transfer_bytes == on_gpus.transfer_bytes
    own = fxsplit.plan(model, BUDGETS, example_inputs=(ids,))
    assert plan.transfer_bytes >= own.transfer_bytes


SPEC = """devices:
  cpu:0: 4MiB
  cpu:1: 4MiB
device_map:
  "": cpu:0
  enc.layer.bias: cpu:1
  post: cpu:1
"""


def test_spec_device_map() -> None:
    torch.manual_seed(0)
    model, inputs = Straddle(), (torch.randn(3, 16),)
    plan = fxsplit.plan(model, spec=SPEC, example_inputs=inputs)
    assert plan.param_devices == read_device_map(model, {"": "cpu:0", "enc.layer.bias": "cpu:1", "post": "cpu:1"})
    pinned = SPEC.replace("device_map:", "pin:")
    with pytest.warns(fxsplit.FxsplitWarning, match=r"<spec>:6: pin\['enc.layer.bias'\]: no module of the model"):
        assert fxsplit.plan(model, spec=pinned, example_inputs=inputs).param_devices == plan.param_devices
    with pytest.raises(fxsplit.SpecError, match=r"<spec>:7: device_map\['postt'\]: key 'postt' names no module"):
        fxsplit.plan(model, spec=SPEC.replace("post:", "postt:"), example_inputs=inputs)
    with pytest.raises(fxsplit.SpecError) as caught:
        fxsplit.load_spec(SPEC.replace("post: cpu:1", "post: cpu:2") + "pin: {pre: cpu:0}\n")
    assert "<spec>:4: device_map: places the weights" in str(caught.value)
    assert "<spec>:7: device_map['post']: puts weights on 'cpu:2', which is not under devices" in str(caught.value)


def test_cli_device_map(tmp_path: Any) -> None:
    import io
    import pathlib

    from fxsplit.cli import main

    root = pathlib.Path(__file__).resolve().parents[1]
    model, device_map = f"{root / 'examples' / 'models.py'}:factory", str(root / "examples" / "tinylm_device_map.json")
    budgets = ["--budget", "cpu:0=1MiB", "--budget", "cpu:1=1MiB"]
    out, err = io.StringIO(), io.StringIO()
    saved = tmp_path / "plan.yaml"
    assert main(["plan", model, *budgets, "--device-map", device_map, "-o", str(saved)], out=out, err=err) == 0
    assert "device map: 16.50 KiB per forward; fxsplit's plan: 8.00 KiB per forward" in out.getvalue()
    assert fxsplit.Plan.from_yaml(saved.read_text()).param_devices["model.layers.4.up.weight"] == "cpu:1"
    out = io.StringIO()
    assert main(["code", model, *budgets, "--device-map", device_map], out=out, err=err) == 0
    assert out.getvalue().startswith("# device map: 16.50 KiB per forward; fxsplit's plan: 8.00 KiB")
    bad = tmp_path / "bad.yaml"
    for text, expected in (
        ('"": cpu:0\nmodel.layrs.0: cpu:1\n', f"{bad}:2: device_map['model.layrs.0']: key 'model.layrs.0' names no"),
        ('{"": 0}', "device_map puts weights on 'cuda:0', which the budgets do not name (they name 'cpu:0', 'cpu:1')"),
        ("[model]", f"{bad}:1: device_map: must map module or tensor names to devices"),
    ):
        bad.write_text(text)
        err = io.StringIO()
        assert main(["plan", model, *budgets, "--device-map", str(bad)], out=io.StringIO(), err=err) == 2
        assert expected in err.getvalue()


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_buffers_written_in_place_are_written_where_the_map_puts_them(trace: str) -> None:
    from helpers import WithBatchNorm

    torch.manual_seed(0)
    model, inputs = WithBatchNorm().train(), (torch.randn(4, 8),)
    stats = {f"bn1.{name}": "cpu:1" for name in ("running_mean", "running_var", "num_batches_tracked")}
    device_map = {"": "cpu:0", **stats, "l3": "cpu:1"}
    reference = copy.deepcopy(model)
    gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=inputs, device_map=device_map, trace=trace)
    assert {name: gm.meta["fxsplit_plan"].param_devices[name] for name in stats} == stats
    for _ in range(2):
        out, expected = gm(*inputs), reference(*inputs)
        torch.testing.assert_close(out, expected)
    default_loss(out).backward()
    default_loss(expected).backward()
    assert_same_grads(model, reference)
    for (name, buffer), (_, original) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(buffer, original, msg=name)
    with pytest.raises(fxsplit.SpecError, match=r"writes 'bn1.running_mean' and 'bn1.running_var' in place, but"):
        fxsplit.plan(
            WithBatchNorm().train(),
            BUDGETS,
            example_inputs=inputs,
            device_map={"": "cpu:0", "bn1.running_mean": "cpu:1"},
        )


@pytest.mark.slow
def test_accelerate_map_of_t5_passed_as_pins() -> None:
    """T5: a tied ``shared`` that runs no op, a decoder block straddling the two devices."""
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=100, use_cache=False
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = accelerate.infer_auto_device_map(model, max_memory={0: int(size / 1.7), 1: size * 2})
    assert device_map["shared"] == 0 and any(key.startswith("decoder.block.0.") for key in device_map)
    pins = {key: f"cpu:{value}" for key, value in device_map.items()}
    ids, decoder_ids = torch.randint(0, 100, (2, 7)), torch.randint(0, 100, (2, 5))
    reference = copy.deepcopy(model)
    with pytest.warns(fxsplit.FxsplitWarning, match=r"pins read as a device map"):
        gm = fxsplit.fxsplit(
            model, BUDGETS, example_inputs=(ids,), example_kwargs={"decoder_input_ids": decoder_ids}, pins=pins
        )
    homes = read_device_map(reference, pins)
    assert {name: gm.meta["fxsplit_plan"].param_devices[name] for name in homes} == homes
    out, expected = gm(ids, decoder_input_ids=decoder_ids), reference(ids, decoder_input_ids=decoder_ids)
    torch.testing.assert_close(out.logits, expected.logits)
    out.logits.square().mean().backward()
    expected.logits.square().mean().backward()
    assert_same_grads(model, reference)


class TwiceWritten(nn.Module):
    """A buffer written twice, the second write with a value made where the map puts ``b``; ``a`` read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(4))
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.s
        self.s.add_(1)
        h = self.b(h) * self.s
        self.s.mul_(h.detach().mean(0).tanh())
        return self.a(h) * self.s


class ClampedActivation(nn.Module):
    """An activation made where the map puts ``a``, written in place after ``b`` runs elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, g = self.a(x), self.b(x)
        h.clamp_(-0.3, 0.3)
        return h, g


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize(
    ("make", "device_map"),
    [(TwiceWritten, {"a": "cpu:0", "b": "cpu:1", "s": "cpu:0"}), (ClampedActivation, {"a": "cpu:1", "b": "cpu:0"})],
)
def test_writes_run_where_the_tensor_lives_under_a_device_map(
    make: Any, device_map: dict[str, str], trace: str
) -> None:
    """Every op that writes a tensor in place runs with it, whatever the map does to the ops around them."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    split = fxsplit.fxsplit(
        model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), trace=trace, device_map=device_map
    )
    with torch.no_grad():
        for _ in range(3):  # the buffer's state carries over from call to call
            torch.testing.assert_close(split(x), reference(x))
    torch.testing.assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))
