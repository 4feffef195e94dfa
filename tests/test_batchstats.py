"""Ops whose result depends on the whole batch (fxsplit.pipeline.batchstats): batch norm in training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.pipeline.batchstats import batch_stat_ops
from fxsplit.tracing.capture import trace


def norms() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 4),
        nn.BatchNorm1d(4),
        nn.LayerNorm(4),  # per sample
        nn.BatchNorm1d(4, track_running_stats=False),  # batch statistics even in eval
        nn.InstanceNorm1d(4),  # per sample and channel
    )


def test_batch_norm_modules_in_training_and_without_running_statistics() -> None:
    graph_module = torch.fx.symbolic_trace(norms())
    assert batch_stat_ops(graph_module) == ["_1", "_3"]
    assert batch_stat_ops(graph_module.eval()) == ["_3"]


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.batch_norm(x, self.mean, self.var, training=True)
        b = F.batch_norm(x, self.mean, self.var, None, None, True)  # training given by position
        c = F.batch_norm(x, self.mean, self.var)  # training defaults to False
        d = F.batch_norm(x, self.mean, self.var, training=False)
        return a + b + c + d


def test_functional_batch_norm_by_its_training_argument() -> None:
    assert batch_stat_ops(torch.fx.symbolic_trace(Functional())) == ["batch_norm", "batch_norm_1"]


def test_export_graphs_in_training_and_in_eval() -> None:
    x = (torch.randn(3, 4),)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
    training = trace(model, example_inputs=x, mode="export").graph_module
    found = batch_stat_ops(training)
    assert len(found) == 1 and "batch_norm" in found[0]
    evaluating = trace(model.eval(), example_inputs=x, mode="export").graph_module
    assert any("batch_norm" in str(node.target) for node in evaluating.graph.nodes)  # the op is there ...
    assert batch_stat_ops(evaluating) == []  # ... with running statistics


def test_a_model_without_batch_norm_has_none() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.Dropout())
    assert batch_stat_ops(torch.fx.symbolic_trace(model)) == []
    assert batch_stat_ops(trace(model, example_inputs=(torch.randn(3, 4),), mode="export").graph_module) == []
