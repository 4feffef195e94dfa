"""Finding a checkpoint's files and reading their headers (fxsplit.checkpoint.formats).

Loading end to end is in test_checkpoint.py; here read_table on its own: which files a path means,
what an entry says, and the problems of the files themselves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import torch as safetensors_torch

from fxsplit.checkpoint.formats import read_table
from fxsplit.errors import CheckpointError


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    safetensors_torch.save_file(tensors, str(path))
    return path


def test_a_safetensors_file_lists_every_tensor_without_reading_data(tmp_path: Path) -> None:
    path = write_safetensors(
        tmp_path / "model.safetensors", {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    )
    table = read_table(path)
    assert table.problems == [] and list(table.entries) == ["a", "b"]
    a, b = table.entries["a"], table.entries["b"]
    assert (a.shape, a.dtype, a.dtype_name, a.nbytes, a.file) == ((2, 3), torch.float32, "F32", 24, path)
    assert (b.shape, b.dtype, b.dtype_name, b.nbytes) == ((4,), torch.bfloat16, "BF16", 8)
    torch.testing.assert_close(table.read("a"), torch.arange(6.0).reshape(2, 3))
    table.close()


def test_a_directory_prefers_the_index_then_the_single_file(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", {"x": torch.zeros(1)})
    assert list(read_table(tmp_path).entries) == ["x"]
    write_safetensors(tmp_path / "part-1.safetensors", {"a": torch.zeros(1)})
    write_safetensors(tmp_path / "part-2.safetensors", {"b": torch.zeros(2)})
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    table = read_table(tmp_path)
    assert list(table.entries) == ["a", "b"] and table.problems == []
    assert table.entries["b"].file == tmp_path / "part-2.safetensors"
    assert list(read_table(tmp_path / "model.safetensors.index.json").entries) == ["a", "b"]  # the index itself


def test_a_directory_without_known_names_takes_every_safetensors_file(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "b.safetensors", {"b": torch.zeros(1)})
    write_safetensors(tmp_path / "a.safetensors", {"a": torch.zeros(1)})
    torch.save({"c": torch.zeros(1)}, tmp_path / "c.bin")
    assert list(read_table(tmp_path).entries) == ["a", "b"]  # sorted; torch files only without safetensors


def test_a_torch_save_file(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2, 2, dtype=torch.float16)}, tmp_path / "weights.pt")
    entry = read_table(tmp_path / "weights.pt").entries["w"]
    assert (entry.shape, entry.dtype, entry.dtype_name, entry.nbytes) == ((2, 2), torch.float16, "torch.float16", 8)
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds list, not a state dict"):
        read_table(tmp_path / "list.pt")


def test_problems_of_the_files_themselves_are_collected(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "one.safetensors", {"a": torch.zeros(1), "b": torch.zeros(1)})
    write_safetensors(tmp_path / "two.safetensors", {"b": torch.ones(1)})
    index = {"weight_map": {"b": "one.safetensors", "a": "two.safetensors"}}  # files in first-listed order
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    table = read_table(tmp_path)
    assert table.problems == [
        "duplicate: 'b' is in both 'one.safetensors' and 'two.safetensors'",
        "index: 'a' is listed in 'two.safetensors', which does not hold it",
    ]
    assert table.entries["b"].file.name == "one.safetensors"  # the first one found is kept


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist; pass a safetensors or torch.save file, an index .json, or a directory"),
        ("empty_dir", "no checkpoint in"),
        ("bad_index", "is not a checkpoint index (a JSON object with a 'weight_map'"),
        ("index_to_nowhere", "checkpoint file"),
        ("short_header", "is not a safetensors file: its header length"),
        ("not_json", "the safetensors header is not JSON"),
        ("malformed_entry", "the header entry of 'a' is malformed"),
        ("beyond_the_file", "claims bytes 0..400 of a data section of 4 bytes; the file is corrupt or truncated"),
    ],
)
def test_what_is_not_a_checkpoint_is_refused(tmp_path: Path, setup: str, message: str) -> None:
    target = tmp_path / "ckpt"
    if setup == "missing":
        pass
    elif setup == "empty_dir":
        target.mkdir()
    elif setup in ("bad_index", "index_to_nowhere"):
        target.mkdir()
        body = "[1, 2]" if setup == "bad_index" else json.dumps({"weight_map": {"a": "gone.safetensors"}})
        (target / "model.safetensors.index.json").write_text(body)
    else:
        target = tmp_path / "model.safetensors"
        headers = {
            "not_json": b"{not json",
            "malformed_entry": json.dumps({"a": {"dtype": "F32"}}).encode(),
            "beyond_the_file": json.dumps({"a": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}).encode(),
        }
        if setup == "short_header":
            target.write_bytes(struct.pack("<Q", 10**6) + b"{}")
        else:
            header = headers[setup]
            target.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(CheckpointError) as info:
        read_table(target)
    assert message in str(info.value)
