"""Checking a checkpoint against the tensors to fill (fxsplit.checkpoint.match), on hand-made tables.

Every problem is found before anything is read; the message groups them by kind and says how to fix
the common ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxsplit.checkpoint.formats import Entry, TableOfContents
from fxsplit.checkpoint.match import Slot, match, unmatched
from fxsplit.errors import CheckpointError

FILE = Path("/ckpt/model.safetensors")


def entry(name: str, shape: tuple[int, ...], dtype: torch.dtype | None = torch.float32, code: str = "F32") -> Entry:
    return Entry(name, shape, dtype, code, FILE, 0)


def table(*entries: Entry, problems: tuple[str, ...] = ()) -> TableOfContents:
    return TableOfContents(Path("/ckpt"), {e.name: e for e in entries}, [], list(problems))


def slot(*names: str, shape: tuple[int, ...] = (2, 2), dtype: torch.dtype = torch.float32, **kwargs: bool) -> Slot:
    return Slot(names, torch.empty(shape, dtype=dtype, device="meta"), kwargs.get("persistent", True))


def problems_of(slots: list[Slot], contents: TableOfContents, **kwargs: object) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        match(slots, contents, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_every_slot_pairs_with_its_entry() -> None:
    slots = [slot("a"), slot("embed.weight", "head.weight"), slot("b", dtype=torch.bfloat16)]
    contents = table(entry("a", (2, 2)), entry("head.weight", (2, 2)), entry("b", (2, 2)), entry("other", (1,)))
    found = match(slots, contents, also_known=["other"])  # a tensor of the model that the split does not hold
    assert [(m.slot.names[0], m.entry.name) for m in found] == [
        ("a", "a"),
        ("embed.weight", "head.weight"),  # a tied tensor, saved under its other name
        ("b", "b"),  # float32 into bfloat16: floating dtypes convert
    ]


def test_a_non_persistent_buffer_may_be_absent_unless_it_is_on_meta() -> None:
    real = Slot(("cache",), torch.zeros(3), False)
    assert match([real], table()) == []
    error = problems_of([slot("cache", shape=(3,), persistent=False)], table())
    assert error.problems == (
        "meta buffer: 'cache' (float32[3]) is on the meta device and no checkpoint holds it (a non-persistent "
        "buffer, computed when the module is built)",
    )
    assert "build the model inside fxsplit.empty_weights()" in str(error)


def test_every_problem_is_listed_with_its_file_and_a_summary() -> None:
    slots = [slot("a"), slot("b"), slot("c", dtype=torch.int64), slot("d"), slot("t1", "t2")]
    contents = table(
        entry("b", (3, 2)),
        entry("c", (2, 2)),
        entry("d", (2, 2), None, "F8_E4M3"),
        entry("x", (5,)),
        problems=("duplicate: 'x' is in both 'a.safetensors' and 'b.safetensors'",),
    )
    error = problems_of(slots, contents)
    assert error.problems == (
        "duplicate: 'x' is in both 'a.safetensors' and 'b.safetensors'",
        "missing: 'a' (float32[2, 2]) is not in the checkpoint",
        "shape: 'b' is float32[3, 2] in 'model.safetensors', float32[2, 2] in the model",
        "dtype: 'c' is float32[2, 2] in 'model.safetensors', int64[2, 2] in the model; only floating dtypes are "
        "converted",
        f"dtype: 'd' in 'model.safetensors' is F8_E4M3, which this torch ({torch.__version__}) has no dtype for",
        "missing: 't1' (float32[2, 2]) (tied to 't2') is not in the checkpoint",
        "unexpected: 'x' (float32[5]) in 'model.safetensors' is not a tensor of the model",
    )
    message = str(error)
    assert message.startswith(
        "checkpoint '/ckpt' does not fit the model (1 duplicate, 2 missing, 1 shape, 2 dtype, 1 unexpected); "
        "nothing was loaded:\n"
    )
    assert message.endswith(
        "check that the model was built from the checkpoint's own config\nto load what fits anyway (a base "
        "model's checkpoint into a model with a new head, a whole model's into its encoder), pass strict=False: "
        "tensors the model lacks are skipped, tensors the checkpoint lacks are initialized as the model initializes "
        "them; both are listed in a warning"
    )
    assert isinstance(error, ValueError)


def test_long_lists_are_cut_but_kept_whole_in_problems() -> None:
    slots = [slot(f"layer{i}") for i in range(25)]
    error = problems_of(slots, table())
    assert len(error.problems) == 25
    assert "... and 5 more missing" in str(error) and "'layer19'" in str(error) and "'layer20'" not in str(error)


def test_names_off_by_a_prefix_get_a_hint() -> None:
    wrapped = problems_of([slot("0.weight"), slot("1.weight")], table(entry("model.0.weight", (2, 2))))
    assert "the checkpoint's names start with 'model.' where the model's do not: was it saved from a wrapper?" in (
        str(wrapped)
    )
    inner = problems_of([slot("backbone.0.weight")], table(entry("0.weight", (2, 2))))
    assert "the model's names start with 'backbone.' where the checkpoint's do not: load it into model.backbone" in (
        str(inner)
    )
    unrelated = problems_of([slot("a.weight")], table(entry("b.weight", (2, 2))))
    assert "names start with" not in str(unrelated)


def test_strict_false_lets_missing_and_extra_tensors_through_and_checks_the_rest() -> None:
    slots = [slot("a"), slot("head.weight"), slot("cache", shape=(3,), persistent=False), slot("b")]
    contents = table(entry("a", (2, 2)), entry("b", (2, 3)), entry("pooler.weight", (4,)))
    error = problems_of(slots, contents, strict=False)
    assert error.problems == (  # a shape and a meta buffer are still problems; 'head.weight' and 'pooler.weight' not
        "meta buffer: 'cache' (float32[3]) is on the meta device and no checkpoint holds it (a non-persistent "
        "buffer, computed when the module is built)",
        "shape: 'b' is float32[2, 3] in 'model.safetensors', float32[2, 2] in the model",
    )
    fine = [slot("a"), slot("head.weight"), Slot(("cache",), torch.zeros(3), False)]  # a real buffer, not saved
    assert [m.slot.names[0] for m in match(fine, contents, strict=False)] == ["a"]
    missing, extra = unmatched(fine, contents, also_known=["b"])
    assert [s.names[0] for s in missing] == ["head.weight"] and extra == ["pooler.weight"]
