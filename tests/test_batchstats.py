"""Ops whose result depends on the whole batch (fxsplit.pipeline.batchstats): batch norm in training; random draws."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.pipeline.batchstats import batch_stat_ops, random_ops
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


class Draws(nn.Module):
    """Dropout as a module and as functions, with p = 0 and in eval; ``rand_like``; an RReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.never, self.rrelu = nn.Dropout(0.1), nn.Dropout(0.0), nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.dropout(x, 0.2, self.training)
        b = F.dropout(x, p=0.0, training=True)  # draws nothing
        c = torch.dropout(x, 0.3, True)  # trained whatever the mode
        return self.drop(a) + self.never(b) + c + torch.rand_like(x) + self.rrelu(x)


def test_random_ops_in_training_and_in_eval() -> None:
    model = Draws()
    assert random_ops(torch.fx.symbolic_trace(model)) == ["dropout", "dropout_2", "drop", "rand_like", "rrelu"]
    assert random_ops(torch.fx.symbolic_trace(model.eval())) == ["dropout_2", "rand_like"]


def test_random_ops_of_export_graphs() -> None:
    x = (torch.randn(3, 4),)
    training = trace(Draws().train(), example_inputs=x, mode="export").graph_module
    found = {str(node.target) for node in training.graph.nodes if node.name in random_ops(training)}
    assert found == {"aten.dropout.default", "aten.rand_like.default", "aten.rrelu.default"}
    assert len(random_ops(training)) == 5
    evaluating = trace(Draws().eval(), example_inputs=x, mode="export").graph_module
    assert len(random_ops(evaluating)) == 2  # torch.dropout(x, 0.3, True) and rand_like


def test_a_model_without_random_ops_has_none() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.ReLU(), nn.LayerNorm(4))
    assert random_ops(torch.fx.symbolic_trace(model)) == []
    assert random_ops(trace(model, example_inputs=(torch.randn(3, 4),), mode="export").graph_module) == []


class Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        plain = F.scaled_dot_product_attention(q, q, q)
        dropped = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        by_position = F.scaled_dot_product_attention(q, q, q, None, 0.2)
        return plain + dropped + by_position


def test_attention_draws_only_with_a_dropout_probability() -> None:
    """Attention is tagged as seeded whatever its ``dropout_p``: only a probability above 0 draws (GPT-2's attention
    in eval, or with attention dropout 0, is no random op)."""
    names = ["scaled_dot_product_attention_1", "scaled_dot_product_attention_2"]
    assert random_ops(torch.fx.symbolic_trace(Attention())) == names
    assert (
        random_ops(trace(Attention(), example_inputs=(torch.randn(2, 2, 4, 8),), mode="export").graph_module) == names
    )
