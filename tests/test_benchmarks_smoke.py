"""The benchmark suite runs end to end on one small model and writes its files (timings are not checked)."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("matplotlib")

from benchmarks import run  # noqa: E402


@pytest.mark.slow  # the quick benchmark suite: ~60 s
def test_quick_suite_on_one_model_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    code = run.main(["--quick", "--models", "mlp48", "--out", str(out), "--llama-layers", "0"])

    names = {p.name for p in out.iterdir()}
    assert {
        "RESULTS.md",
        "results.json",
        "quality_bytes.png",
        "time_to_split.png",
        "planning_scaling.png",
        "runtime_overhead.png",
    } <= names
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
    assert all(
        r["outputs_match"] == {"fxsplit": True, "accelerate": True} for r in results["planning"]["time_to_split"]
    )
    assert {r["n_devices"] for r in results["runtime"]["rows"]} == {2, 4}
    assert all(all(r["outputs_match"].values()) for r in results["runtime"]["rows"])
    assert all("pass" in bar for bar in results["bars"].values())
    assert code == run.exit_code(results["bars"])  # timing bars may fail under load: the exit code says so
    assert len(results["commit"]["commit"]) == 40 or results["commit"]["commit"] == "unknown"

    text = (out / "RESULTS.md").read_text()
    for heading in ("## Bars", "## 1. Placement quality", "## 2. Planning speed", "## 3. Runtime overhead"):
        assert heading in text
    optimality = results["quality"]["optimality"]  # the default placement against brute force, quick: 80 DAGs
    assert optimality["summary"]["cases"] == 80 and set(optimality["bars"]) <= set(results["bars"])
    assert "### Against brute force on small DAGs" in text and "- Default placement against brute force" in text
    assert results["machine"]["cpu"] in text
    assert results["commit"]["commit"] == "unknown" or f"at commit `{results['commit']['commit']}`" in text


def test_unknown_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown part"):
        run.main(["--parts", "speed", "--out", str(tmp_path)])


def test_exit_code_is_1_when_a_bar_fails_and_info_bars_never_fail() -> None:
    passing = {"deep: plan <= 50 ms at 2k ops": {"pass": True, "value": "37.8 ms"}}
    info = {"info: cut bytes <= Accelerate's between the given devices": {"pass": False, "info": True}}
    failing = {"gpt2 N=2: fxsplit <= 1.03 x hand placement": {"pass": False, "value": "1.05"}}
    assert run.exit_code(passing) == run.exit_code({**passing, **info}) == run.EXIT_BARS_PASS == 0
    assert run.exit_code({**passing, **info, **failing}) == run.EXIT_BAR_FAILED == 1
    lines, failed = run.verdicts({**passing, **info, **failing})
    assert failed == ["gpt2 N=2: fxsplit <= 1.03 x hand placement"]
    assert lines == [
        "  PASS  deep: plan <= 50 ms at 2k ops  37.8 ms",
        "  no    info: cut bytes <= Accelerate's between the given devices  ",
        "  FAIL  gpt2 N=2: fxsplit <= 1.03 x hand placement  1.05",
    ]


def test_the_measured_commit_is_recorded() -> None:
    from benchmarks.measure import git_commit
    from benchmarks.report import _at_commit

    head = subprocess.run(
        ["git", "-C", str(Path(__file__).parents[1]), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    state = git_commit()
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert state["commit"] == head.stdout.strip() and isinstance(state["dirty"], bool)
    assert (
        _at_commit({"commit": "abc", "dirty": True})
        == "at commit `abc` with uncommitted changes to fxsplit/ or benchmarks/ "
    )
    assert _at_commit({"commit": "abc", "dirty": False}) == "at commit `abc` "


@pytest.mark.slow  # one tiny case of the offload benchmark: ~8 s
def test_offload_benchmark_on_a_tiny_model_writes_its_results(tmp_path: Path) -> None:
    from benchmarks import offload

    code = offload.main(["--models", "mlp-tiny", "--fractions", "0.5", "--quick", "--out", str(tmp_path)])

    results = json.loads((tmp_path / offload.RESULTS_JSON).read_text())
    assert results["machine"]["torch_threads"] == 1 and results["quick"] is True
    [row] = results["offload"]["rows"]
    assert (row["model"], row["fraction"], row["n_devices"]) == ("mlp-tiny", 0.5, 2)
    assert row["device_budget"] == int(0.5 * row["total_bytes"] / 2)
    acc, fx = row["accelerate"], row["fxsplit"]
    assert acc["placed"] and acc["offloads"] and fx["placed"]
    # both tools really stream: Accelerate's hooks as its map says, fxsplit's generated code as its plan says
    assert acc["stream_bytes"] == acc["host_bytes"] + acc["disk_bytes"] == acc["stream_bytes_scored"] > 0
    assert fx["stream_bytes_measured"] == fx["stream_bytes"] > 0
    assert sum(fx["device_bytes"]) + fx["host_bytes"] + fx["disk_bytes"] == row["total_bytes"]
    assert row["outputs_match"] == {name: True for name in row["median_ms"]}
    assert {"eager", "accelerate", "fxsplit", "fxsplit-again", "fxsplit-fx"} == set(row["median_ms"])
    assert row["ratio_to_accelerate"]["accelerate"] == 1.0 and row["aa_ratio"] > 0
    assert {"inference_mode", "prefetch_0"} == set(row["record"])
    assert fx["prefetch"] in (0, 1) and isinstance(fx["warnings"], list)  # 1 asked; lowered with a warning
    bars = results["offload"]["bars"]
    assert all("pass" in bar for bar in bars.values())
    assert bars["offload: fxsplit places every case Accelerate places with offload"]["pass"]
    assert bars["offload: fxsplit's outputs equal the unsplit model's"]["pass"]
    assert code == run.exit_code(bars)  # the bytes and timing bars may fail: the exit code says so
    text = (tmp_path / offload.RESULTS_MD).read_text()
    for heading in ("## Headlines", "## Bars", "## Cases", "## For the record"):
        assert heading in text


@pytest.mark.slow  # the generation benchmark on 2 devices, one timing round: ~30 s
def test_generate_benchmark_on_two_devices_writes_its_results(tmp_path: Path) -> None:
    from benchmarks import generate

    code = generate.main(["--devices", "2", "--rounds", "1", "--out", str(tmp_path)])

    results = json.loads((tmp_path / generate.RESULTS_JSON).read_text())
    assert results["machine"]["torch_threads"] == 1
    result = results["generate"]
    variants = {"wrapper", "generate", "fxsplit-2", "fxsplit-2-again", "accelerate-2", "accelerate-2-loop"}
    assert variants <= set(result["timing"]) and all(len(v) == 1 for v in result["seconds"].values())
    assert len(result["expected_tokens"]) == generate.NEW_TOKENS
    assert result["tokens_match"] == {name: True for name in result["timing"]}  # every variant, Accelerate too
    [case] = result["cases"]
    fx, acc = case["fxsplit"], case["accelerate"]
    assert case["n_devices"] == 2 and case["budget"] == int(1.1 * result["sizes"]["total"] / 2)
    assert sum(fx["cache_bytes"]) == sum(acc["cache_bytes"]) == result["sizes"]["cache"]
    assert sorted(layer for layers in fx["cache_layers"] for layer in layers) == list(range(generate.LAYERS))
    assert max(fx["charged_bytes"]) <= case["budget"]
    bars = result["bars"]
    assert bars["generate: fxsplit's tokens equal model.generate's (every split)"]["pass"]
    assert code == run.exit_code(bars)  # the timing bar may fail on one round: the exit code says so
    text = (tmp_path / generate.RESULTS_MD).read_text()
    for heading in ("## Headlines", "## Bars", "## Tokens per second", "## Weights and cache per device"):
        assert heading in text


def test_resnet50_is_the_standard_one_and_the_hand_splits_follow_the_tutorial() -> None:
    from benchmarks.throughput_models import ResNet, hand_pins, model_spec

    assert sum(p.numel() for p in ResNet().parameters()) == 25_557_032  # torchvision's resnet50
    pins = hand_pins(model_spec("resnet50", False), ("a", "b"))
    assert {k for k, v in pins.items() if v == "a"} == {"conv1", "bn1", "maxpool", "layer1", "layer2"}
    assert {k for k, v in pins.items() if v == "b"} == {"layer3", "layer4", "fc"}
    gpt2 = hand_pins(model_spec("gpt2", False), ("a", "b"))
    assert [gpt2[f"model.transformer.h.{i}"] for i in range(12)] == ["a"] * 6 + ["b"] * 6
    assert gpt2["model.transformer.wte"] == "a" and gpt2["model.lm_head"] == "b"
    four = hand_pins(model_spec("gpt2", False), ("a", "b", "c", "d"))
    assert [four[f"model.transformer.h.{i}"] for i in range(12)] == [d for d in "abcd" for _ in range(3)]
    assert hand_pins(model_spec("resnet50", False), ("a", "b", "c", "d"))["layer3"] == "c"


def test_throughput_bars_fail_a_one_stage_default_and_only_info_for_other_plans() -> None:
    from benchmarks.pipeline_throughput import throughput_bars

    def variant(stages: int, vs_ceiling: float, balance: float | None) -> dict[str, object]:
        return {"stages": stages, "vs_ceiling": vs_ceiling, "vs_single": vs_ceiling * 1.7, "balance": balance}

    result = {
        "models": [
            {
                "model": "m",
                "ceiling": {"vs_single": 1.7},
                "variants": {"default": variant(1, 0.9, None), "hand": variant(2, 0.85, 1.05)},
            },
            {"model": "broken", "error": "torchrun exited 1: boom"},
        ]
    }
    bars = throughput_bars(result)
    assert not bars["throughput m default: pipeline >= 0.8 x two-process ceiling"]["pass"]  # one stage: no pipeline
    assert bars["throughput m default: slowest / mean stage <= 1.1 (measured)"]["value"] == "one stage"
    hand = bars["info: throughput m hand: pipeline >= 0.8 x two-process ceiling"]
    assert hand["pass"] and hand["info"]
    assert bars["info: throughput m hand: slowest / mean stage <= 1.1 (measured)"]["pass"]
    assert not bars["throughput broken: the benchmark ran"]["pass"]
    assert run.verdicts(bars)[1] == [
        "throughput m default: pipeline >= 0.8 x two-process ceiling",
        "throughput m default: slowest / mean stage <= 1.1 (measured)",
        "throughput broken: the benchmark ran",
    ]


@pytest.mark.slow  # two gloo processes on the tiny ResNet: ~40 s
def test_pipeline_throughput_benchmark_on_a_tiny_resnet_writes_its_results(tmp_path: Path) -> None:
    from benchmarks import pipeline_throughput

    code = pipeline_throughput.main(["--quick", "--models", "resnet50", "--out", str(tmp_path)])

    results = json.loads((tmp_path / pipeline_throughput.RESULTS_JSON).read_text())
    assert results["machine"]["torch_threads"] == 1 and results["quick"] is True
    [model] = results["throughput"]["models"]
    assert model["model"] == "resnet50" and model["settings"]["tiny"]
    assert model["single"]["steps_per_s"] > 0 and len(model["ceiling"]["copies_steps_per_s"]) == 2
    variants = model["variants"]
    assert {"default", "balanced", "hand"} <= set(variants) and not any("error" in v for v in variants.values())
    for name in ("balanced", "hand"):  # these plans spread over both ranks
        assert variants[name]["stages"] == 2 and variants[name]["devices"] == ["cpu:0", "cpu:1"]
    assert [s["blocks"] for s in variants["hand"]["per_stage"]] == [["layer1.0", "layer2.0"], ["layer3.0", "layer4.0"]]
    for v in variants.values():
        assert len(v["stage_times"]) == len(v["stage_s"]) == v["stages"] and min(v["stage_s"]) > 0
        rounds = zip(v["rounds_steps_per_s"], model["ceiling"]["rounds_steps_per_s"], strict=True)
        assert v["vs_ceiling"] == pytest.approx(statistics.median(p / c for p, c in rounds))
        assert sum(s["parameters"] for s in v["per_stage"]) == model["parameters"]  # every weight on one stage
    four = model["four_stages"]
    assert set(four) == set(variants) and not any("error" in v for v in four.values())
    assert [s["blocks"] for s in four["hand"]["per_stage"]] == [[f"layer{i}.0"] * 2 for i in range(1, 5)]
    assert four["hand"]["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"] and len(four["hand"]["stage_s"]) == 4
    bars = results["throughput"]["bars"]
    assert "throughput resnet50 default, 4 devices: slowest / mean stage <= 1.1 (measured)" in bars
    assert all("pass" in bar for bar in bars.values())
    assert code == run.exit_code(bars)  # timing bars may fail: the exit code says so
    text = (tmp_path / pipeline_throughput.RESULTS_MD).read_text()
    for heading in ("## Headlines", "## Bars", "## Throughput", "## Stage times"):
        assert heading in text
