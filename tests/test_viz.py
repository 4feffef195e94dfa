"""Drawing a split: SVG/PNG/DOT when graphviz is there, an install hint when it is not."""

from __future__ import annotations

import builtins
import shutil
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit.api import trace_and_plan
from fxsplit.factory import load_model
from fxsplit.viz import INSTALL_HINT, auto_depth, render, to_dot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def planned() -> tuple[torch.fx.GraphModule, fxsplit.Plan]:
    loaded = load_model(f"{ROOT / 'examples' / 'models.py'}:factory")
    # Pinning the embedding away from its tied head forces a copy of the weight (a parameter cut) to draw
    # (without replicas, which would hold it on both devices instead).
    pins = {"lm_head": "cpu:2", "model.embed_tokens": "cpu:0"}
    spec = str(ROOT / "examples" / "spec_example.yaml")
    made = trace_and_plan(loaded.model, None, loaded.example_inputs, {"spec": spec, "pins": pins, "replicate": False})
    return made.traced.graph_module, made.plan


def test_dot_source_colours_devices_and_labels_cuts(planned: tuple) -> None:
    pytest.importorskip("graphviz")
    graph_module, plan = planned
    source = to_dot(graph_module, plan).source
    assert source.count("subgraph cluster_") == 3
    activation_cuts = [c for c in plan.cuts if c.kind == "activation"]
    assert activation_cuts
    for cut in activation_cuts:
        assert f'label="{fxsplit.format_size(cut.nbytes)}"' in source
    assert "128.00 KiB (model.embed_tokens.weight)" in source and "style=dashed" in source
    assert "memory per device" in source and "51.20 KiB reserved" in source
    grouped = to_dot(graph_module, plan, depth=3).source
    assert "model.layers.3\\n5 ops" in grouped
    assert len(grouped) < len(source)


def test_export_input_check_is_not_drawn(planned: tuple) -> None:
    pytest.importorskip("graphviz")
    graph_module, plan = planned
    assert plan.trace == "export" and "_guards_fn" in {n.name for n in graph_module.graph.nodes}
    assert "_guards_fn" not in to_dot(graph_module, plan).source


def test_auto_depth_groups_big_graphs(planned: tuple) -> None:
    pytest.importorskip("graphviz")
    graph_module, plan = planned
    assert auto_depth(graph_module, plan, limit=1000) is None
    assert auto_depth(graph_module, plan, limit=30) == 3


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
@pytest.mark.parametrize("suffix", ["svg", "png"])
def test_renders_pictures(planned: tuple, tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("graphviz")
    graph_module, plan = planned
    target = render(graph_module, plan, tmp_path / f"split.{suffix}", depth=3)
    data = target.read_bytes()
    if suffix == "svg":
        assert data.lstrip().startswith(b"<?xml") and b"<svg" in data and b"cpu:2" in data
    else:
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_missing_dot_program_gives_the_hint(planned: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graphviz = pytest.importorskip("graphviz")

    def no_dot(*args: object, **kwargs: object) -> bytes:
        raise graphviz.ExecutableNotFound(("dot",))

    monkeypatch.setattr(graphviz.Digraph, "pipe", no_dot)
    with pytest.raises(fxsplit.FxsplitError, match="'dot' program is not installed") as caught:
        render(*planned, tmp_path / "split.svg")
    assert "apt-get install graphviz" in str(caught.value)


def test_missing_graphviz_package_gives_the_hint(
    planned: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def without_graphviz(name: str, *args: object, **kwargs: object) -> object:
        if name == "graphviz" or name.startswith("graphviz."):
            raise ImportError("No module named 'graphviz'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_graphviz)
    with pytest.raises(fxsplit.FxsplitError) as caught:
        render(*planned, tmp_path / "split.dot")
    assert str(caught.value) == INSTALL_HINT
    assert "pip install graphviz" in INSTALL_HINT and "apt-get install graphviz" in INSTALL_HINT
    assert not (tmp_path / "split.dot").exists()
