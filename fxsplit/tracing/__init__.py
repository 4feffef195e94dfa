"""Stage 1, tracing: the user's model -> an FX graph, without changing the model.

* :mod:`~fxsplit.tracing.capture`: :func:`trace`, torch.export with a torch.fx fallback; an fx graph's shapes come
  from :mod:`~fxsplit.tracing.fxshapes`; a model with weights on meta is exported with them as fakes on its inputs'
  device (:mod:`~fxsplit.tracing.metaweights`).
* :mod:`~fxsplit.tracing.example_inputs`: can the model run its example inputs?
* :mod:`~fxsplit.tracing.dynamic`: which input sizes an export graph keeps variable;
  :mod:`~fxsplit.tracing.keyworddefaults`, its constant keyword inputs as defaults (``gm(ids)`` without ``use_cache``).
* :mod:`~fxsplit.tracing.gradmode`: ``torch.no_grad()`` regions kept in the graph.
* :mod:`~fxsplit.tracing.checkpoints`: ``torch.utils.checkpoint`` calls kept whole
  (:mod:`~fxsplit.tracing.keptcheckpoint`: the split recomputes them; :mod:`~fxsplit.tracing.fxcheckpoint`, folded
  under torch.fx), else traced as plain calls (gradients kept); :mod:`~fxsplit.tracing.customgrad`, custom
  autograd Functions kept whole, one node per call (their backward included; :mod:`~fxsplit.tracing.functionop`,
  the op that holds a kept call in a torch.export graph).
* :mod:`~fxsplit.tracing.graphinfo`: facts about nodes that later stages share;
  :mod:`~fxsplit.tracing.viewops`, the ops whose result shares its input's storage;
  :mod:`~fxsplit.tracing.writers`, the ops of a graph that write an input in place.
* :mod:`~fxsplit.tracing.rowsplit`: a linear op split by the rows of its weight (a graph rewrite for pipeline stages).
"""

from fxsplit.tracing.capture import Traced, trace

__all__ = ["Traced", "trace"]
