"""A model's structure as a hash, and the list of differences (fxsplit.planning.fingerprint)."""

from __future__ import annotations

import torch
from torch import nn

from fxsplit.planning.fingerprint import describe, differences, fingerprint_of, tensor_signature


class Tied(nn.Module):
    def __init__(self, vocab: int = 10, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_tensor_signature_is_dtype_and_shape_only() -> None:
    assert tensor_signature(torch.zeros(2, 3)) == "float32[2, 3]"
    assert tensor_signature(torch.zeros((), dtype=torch.int64)) == "int64[]"
    assert tensor_signature(torch.empty(5, 0, device="meta", dtype=torch.bfloat16)) == "bfloat16[5, 0]"
    assert tensor_signature(torch.ones(2, 3)) == tensor_signature(torch.zeros(2, 3))  # values do not count


def test_describe_lists_parameters_buffers_and_tied_names() -> None:
    fingerprint, tensors, tied = describe(Tied())
    assert tensors == {"embed.weight": "float32[10, 4]", "head.weight": "float32[10, 4]", "steps": "int64[]"}
    assert tied == (("embed.weight", "head.weight"),)
    assert fingerprint == fingerprint_of(tensors, tied)
    assert fingerprint.startswith("sha256:") and len(fingerprint) == len("sha256:") + 16


def test_fingerprint_ignores_order_but_not_structure() -> None:
    tensors = {"a": "float32[2]", "b": "int64[]"}
    tied = (("a", "b"),)
    same = fingerprint_of(tensors, tied)
    assert fingerprint_of(dict(reversed(tensors.items())), (("b", "a"),)) == same
    assert fingerprint_of({**tensors, "a": "float32[3]"}, tied) != same  # a shape
    assert fingerprint_of({**tensors, "a": "float16[2]"}, tied) != same  # a dtype
    assert fingerprint_of({"c": "float32[2]", "b": "int64[]"}, (("c", "b"),)) != same  # a name
    assert fingerprint_of(tensors, ()) != same  # the ties


def test_fingerprint_of_a_model_does_not_depend_on_its_values_or_device() -> None:
    torch.manual_seed(0)
    first = describe(Tied())[0]
    torch.manual_seed(1)
    second = Tied()
    assert describe(second)[0] == first
    with torch.device("meta"):
        on_meta = Tied()
    assert describe(on_meta)[0] == first


def test_no_differences_for_the_same_structure() -> None:
    _, tensors, tied = describe(Tied())
    assert differences(tensors, tied, Tied()) == []


def test_differences_name_missing_extra_changed_and_tied() -> None:
    _, tensors, tied = describe(Tied())
    other = Tied(vocab=12)
    other.head.weight = nn.Parameter(torch.zeros(12, 4))  # untied
    del other.steps
    other.register_buffer("count", torch.zeros(1))
    assert differences(tensors, tied, other) == [
        "missing: the plan has 'steps' (int64[]), the model does not",
        "extra: the model has 'count' (float32[1]), the plan does not",
        "changed: 'embed.weight' is float32[12, 4] in the model, float32[10, 4] in the plan",
        "changed: 'head.weight' is float32[12, 4] in the model, float32[10, 4] in the plan",
        "tied: the plan ties ['embed.weight', 'head.weight'], the model does not",
    ]
    _, untied_tensors, untied = describe(other)
    assert differences(untied_tensors, untied, other) == []
    assert "tied: the model ties ['embed.weight', 'head.weight'], the plan does not" in differences(
        {**tensors, "count": "float32[1]"}, (), Tied()
    )


def test_a_plan_dtype_excuses_floating_tensors_cast_to_it_only() -> None:
    _, tensors, tied = describe(Tied())
    cast = Tied().to(torch.bfloat16)
    assert cast.steps.dtype == torch.int64  # .to(dtype) leaves integer buffers alone
    assert differences(tensors, tied, cast, dtype="bfloat16") == []
    assert differences(tensors, tied, cast) == [
        "changed: 'embed.weight' is bfloat16[10, 4] in the model, float32[10, 4] in the plan",
        "changed: 'head.weight' is bfloat16[10, 4] in the model, float32[10, 4] in the plan",
    ]
    assert len(differences(tensors, tied, cast, dtype="float16")) == 2  # cast to another dtype than the plan's
    changed = {**tensors, "steps": "int32[]"}  # an integer recorded otherwise is a difference whatever the dtype
    assert differences(changed, tied, cast, dtype="bfloat16") == [
        "changed: 'steps' is int64[] in the model, int32[] in the plan"
    ]
    resized = {**tensors, "embed.weight": "float32[9, 4]"}  # the cast does not excuse another shape
    assert differences(resized, tied, cast, dtype="bfloat16") == [
        "changed: 'embed.weight' is bfloat16[10, 4] in the model, float32[9, 4] in the plan"
    ]
