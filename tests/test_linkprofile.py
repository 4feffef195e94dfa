"""Measured links (:mod:`fxsplit.cost.linkprofile`): ``profile=True`` prices copies as they run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.cost.linkprofile import LARGEST_PROBE, measure_copy, profile_links
from fxsplit.hardware import Hardware, Link
from fxsplit.planning.timing import op_timing


def test_logical_cpu_devices_share_one_measured_link_with_a_positive_latency_and_finite_bandwidth() -> None:
    links = profile_links(["cpu:0", "cpu:1", "cpu:2"], largest=4 * 2**20, repeats=3)
    assert sorted(links) == [(a, b) for a in ("cpu:0", "cpu:1", "cpu:2") for b in ("cpu:0", "cpu:1", "cpu:2") if a != b]
    first = links[("cpu:0", "cpu:1")]
    assert all(link is first for link in links.values())
    assert first.latency > 0
    assert 1e6 < first.bandwidth < 1e13  # between 1 MB/s and 10 TB/s: a real copy, not a no-op


def test_a_large_copy_takes_longer_than_a_small_one() -> None:
    assert measure_copy("cpu:0", "cpu:1", 64 * 2**20, repeats=3) > measure_copy("cpu:0", "cpu:1", 4096, repeats=3)


def test_the_bandwidth_probe_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []

    def fake(source: str, destination: str, nbytes: int, repeats: int) -> float:
        sizes.append(nbytes)
        return 1e-3 * nbytes / 4096

    monkeypatch.setattr("fxsplit.cost.linkprofile.measure_copy", fake)
    profile_links(["cpu:0", "cpu:1"], largest=2**40)
    profile_links(["cpu:0", "cpu:1"], largest=10)
    assert sizes == [4096, LARGEST_PROBE, 4096, 2**20]


def test_op_timing_takes_measured_links_for_the_pairs_they_name_and_the_hardware_for_the_rest() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    gm = torch.fx.symbolic_trace(model)
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    hardware = Hardware.coerce({"links": {"cpu:0 <-> cpu:2": {"bandwidth": 7.0, "latency": 0.5}}})
    measured = {("cpu:0", "cpu:1"): Link(bandwidth=11.0, latency=0.25)}
    timing = op_timing(gm, ops, ["cpu:0", "cpu:1", "cpu:2"], hardware, measured_links=measured)
    assert timing.bandwidth[0, 1] == 11.0 and timing.latency[0, 1] == 0.25
    assert timing.bandwidth[0, 2] == 7.0 and timing.latency[0, 2] == 0.5
    assert np.isfinite(timing.bandwidth[1, 0])  # not measured, not named: the default link


def test_profile_true_replaces_a_wrong_link_model_with_the_measured_copy_time() -> None:
    """A hardware model claiming 1 KB/s between the devices makes every copy cost seconds, so the
    pipeline stays on one device; the profile measures the real copy, and the stages spread with copy
    times of what a copy here takes."""
    torch.manual_seed(0)
    # Blocks of ~1 GFLOP (10-30 ms on one thread): a 1 MiB copy is worth it even where copying memory is slow
    # (seen: 8 ms per MiB on a loaded machine, 0.1 ms on a quiet one).
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(4)])
    x = torch.randn(512, 1024)
    slow = {"links": {"cpu <-> cpu": {"bandwidth": 1e3, "latency": 1e-3}}}
    budgets = {"cpu:0": "32MiB", "cpu:1": "32MiB"}
    pipeline = fxsplit.PipelineConfig(chunks=2)
    guessed = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=pipeline, hardware=slow)
    measured = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=pipeline, hardware=slow, profile=True)
    assert guessed.timing is not None and measured.timing is not None
    measured_copies = sum(stage["copies"] for stage in measured.timing["stages"].values())
    assert not guessed.cuts  # a 1 MiB copy at 1 KB/s costs more than any stage saves
    assert measured.cuts and 0 < measured_copies < 0.05  # 1 MiB copies in memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copies between a GPU and the host")
def test_links_to_and_from_a_gpu_are_measured_each_way() -> None:
    links = profile_links(["cuda:0", "cpu:0"], largest=16 * 2**20, repeats=3)
    assert set(links) == {("cuda:0", "cpu:0"), ("cpu:0", "cuda:0")}
    for link in links.values():
        assert link.latency > 0 and 1e6 < link.bandwidth < 1e13
