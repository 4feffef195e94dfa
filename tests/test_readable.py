"""fxsplit.show_code: the generated forward arranged for reading, statement for statement the same."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import fxsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from models import TinyLM  # noqa: E402
from three_layer import ToyModel  # noqa: E402

TUTORIAL = """\
# fxsplit: readable view of gm.code (same statements; print(gm.code) for the exact program)
def forward(self, x):
    # ---- cpu:0 ----
    to = x.to('cpu:0')
    net1_weight = self.net1.weight
    net1_bias = self.net1.bias
    linear = torch.ops.aten.linear.default(to, net1_weight, net1_bias)
    relu = torch.ops.aten.relu.default(linear)
    # ---- cpu:1 ----
    to_1 = relu.to('cpu:1')
    net2_weight = self.net2.weight
    net2_bias = self.net2.bias
    linear_1 = torch.ops.aten.linear.default(to_1, net2_weight, net2_bias)
    return linear_1"""

TINY_LM_TAIL = """\
    # ---- cpu:1 ----
    to_1 = add.to('cpu:1')
    model_layers_1_norm_weight = getattr(self.model.layers, "1").norm.weight
    model_layers_1_norm_bias = getattr(self.model.layers, "1").norm.bias
    layer_norm_1 = torch.ops.aten.layer_norm.default(to_1, [16], model_layers_1_norm_weight, model_layers_1_norm_bias, 1e-05, False)
    model_layers_1_up_weight = getattr(self.model.layers, "1").up.weight
    model_layers_1_up_bias = getattr(self.model.layers, "1").up.bias
    linear_2 = torch.ops.aten.linear.default(layer_norm_1, model_layers_1_up_weight, model_layers_1_up_bias)
    gelu_1 = torch.ops.aten.gelu.default(linear_2)
    model_layers_1_down_weight = getattr(self.model.layers, "1").down.weight
    model_layers_1_down_bias = getattr(self.model.layers, "1").down.bias
    linear_3 = torch.ops.aten.linear.default(gelu_1, model_layers_1_down_weight, model_layers_1_down_bias)
    add_1 = torch.ops.aten.add.Tensor(to_1, linear_3)
    model_norm_weight = self.model.norm.weight
    model_norm_bias = self.model.norm.bias
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_1, [16], model_norm_weight, model_norm_bias, 1e-05, False)
    to_2 = lm_head_weight.to('cpu:1')
    linear_4 = torch.ops.aten.linear.default(layer_norm_2, to_2)
    return linear_4"""  # noqa: E501 - generated code, compared as it is


def tutorial_split() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return fxsplit.fxsplit(ToyModel(), {"cpu:0": "2KiB", "cpu:1": "2KiB"}, example_inputs=(torch.randn(20, 10),))


def tiny_lm_split(trace: str) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 5))
    return fxsplit.fxsplit(
        TinyLM(vocab=64, width=16, depth=2),
        {"cpu:0": "16KiB", "cpu:1": "16KiB"},
        example_inputs=(ids,),
        mode="weights",
        trace=trace,
        pins={"model.embed_tokens": "cpu:0", "lm_head": "cpu:1"},
        replicate=False,  # the tied weight copied (with replicas, cpu:1 would read its own copy)
    )


def test_tutorial_model_reads_as_expected() -> None:
    assert fxsplit.show_code(tutorial_split()) == TUTORIAL


def test_two_device_tiny_lm_reads_as_expected() -> None:
    text = fxsplit.show_code(tiny_lm_split("export"))
    assert text.endswith(TINY_LM_TAIL)
    assert "_guards_fn" not in text and "tree_flatten_spec" not in text and "= None" not in text
    assert text.count("# ---- cpu:0 ----") == 1 and text.count("# ---- cpu:1 ----") == 1


def _statements(code: str) -> list[str]:
    """The assignments and return of ``code`` without the frees, folded plumbing and comments."""
    kept = []
    for line in code.splitlines():
        line = re.sub(r";  (?:\w+ = )+None$", "", line).split("  # ")[0].rstrip()
        if not line.startswith("    ") or line.strip().startswith("#"):
            continue
        if "_guards_fn" in line or "tree_flatten_spec" in line:
            continue
        kept.append(re.sub(r"pytree\.tree_unflatten\(\((\w+),\), self\._out_spec\)", r"\1", line))
    return kept


@pytest.mark.parametrize("trace", ["export", "fx"])
def test_every_statement_of_the_code_is_shown_once(trace: str) -> None:
    split = tiny_lm_split(trace)
    shown = fxsplit.show_code(split)
    assert sorted(_statements(shown)) == sorted(_statements(split.code))
    if trace == "fx":  # the tied embedding lives on cpu:0 and is copied to the head on cpu:1
        assert "model_embed_tokens_weight = self.model.embed_tokens.weight  # on cpu:0" in shown


def test_each_line_follows_the_header_of_the_device_it_runs_on() -> None:
    split = tiny_lm_split("fx")
    devices = {n.name: n.meta.get("fxsplit_device") for n in split.graph.nodes}
    current = None
    for line in fxsplit.show_code(split).splitlines():
        header = re.match(r"    # ---- (\S+) ----", line)
        if header:
            current = header.group(1)
            continue
        assigned = re.match(r"    (\w+) = ", line)
        if assigned and devices.get(assigned.group(1)) and "  # on " not in line:
            assert devices[assigned.group(1)] == current, line
