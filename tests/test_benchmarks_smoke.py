"""The benchmark suite runs end to end on one small model and writes its files (timings are not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("matplotlib")

from benchmarks import run  # noqa: E402


def test_quick_suite_on_one_model_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    assert run.main(["--quick", "--models", "mlp48", "--out", str(out), "--llama-layers", "0"]) == 0

    names = {p.name for p in out.iterdir()}
    assert {"RESULTS.md", "results.json", "quality_bytes.png", "time_to_split.png", "planning_scaling.png",
            "runtime_overhead.png"} <= names
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["models"] == ["mlp48"] and results["machine"]["torch_threads"] == 1
    rows = results["quality"]["rows"]
    assert [(r["n_devices"], r["budget"]) for r in rows] == [(2, "tight"), (2, "loose"), (4, "tight"), (4, "loose")]
    for row in rows:  # a chain: fxsplit, the reference and Accelerate all cut one activation per boundary used
        assert row["fxsplit"]["placed"] and not row["fxsplit"]["exceeded"]
        assert row["fxsplit"]["bytes_between"] == row["fxsplit"]["plan_transfer_bytes"]
        assert row["fxsplit"]["bytes_between"] <= row["reference"]["bytes_between"]
        assert set(row["accelerate"]) == {"accelerate", "accelerate-plain"}
    assert all(r["outputs_match"] == {"fxsplit": True, "accelerate": True}
               for r in results["planning"]["time_to_split"])
    assert {r["n_devices"] for r in results["runtime"]["rows"]} == {2, 4}
    assert all(all(r["outputs_match"].values()) for r in results["runtime"]["rows"])
    assert all("pass" in bar for bar in results["bars"].values())

    text = (out / "RESULTS.md").read_text()
    for heading in ("## Bars", "## 1. Placement quality", "## 2. Planning speed", "## 3. Runtime overhead"):
        assert heading in text
    assert results["machine"]["cpu"] in text


def test_unknown_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown part"):
        run.main(["--parts", "speed", "--out", str(tmp_path)])
