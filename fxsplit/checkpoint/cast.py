"""Cast a model to the plan's dtype before it is traced, when a checkpoint will fill it at that dtype.

A checkpoint is loaded as the plan's ``dtype`` (``dtype="bfloat16"``), so the
split runs a bf16 model. Its graph must be that model's: a trace bakes the
dtypes it saw into the graph (torch.export's ``_assert_tensor_metadata``
checks, a mask made with ``dtype=self.weight.dtype``), and a graph traced at
float32 then fails, or computes in float32, on bf16 weights. So the floating
parameters and persistent buffers are cast first (the same tensor objects, new
data; on ``meta`` this costs nothing), and put back if the call fails.

Non-persistent buffers are no checkpoint's: the model computes them when it is
built (a rotary embedding's ``inv_freq``), and keeps them at the dtype it made
them, as transformers' ``from_pretrained(dtype=...)`` does (a bf16 rotary
table would turn every position's angle by a bf16 rounding), unless the traced
graph shows the cast model needs one at the dtype (:mod:`fxsplit.checkpoint.computed`):
then it is cast too and the model traced again. The graph is then
traced at the dtypes the split runs at, so the plan counts its tensors as traced
(:class:`CastForLoad` says so), not as if all were the plan's dtype: a causal
LM's loss casts the bf16 logits to float32, and counted at bf16 that tensor
was half its size.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.checkpoint import standin
from fxsplit.checkpoint.computed import kept_buffers, meeting_buffers
from fxsplit.checkpoint.fed import traced_as_fed
from fxsplit.cost.keptdtype import kept_tensors
from fxsplit.cost.walk import forget_walk, named_tensors
from fxsplit.errors import FxsplitWarning, TraceError

if TYPE_CHECKING:
    from fxsplit.planning.fingerprint import Structure
    from fxsplit.tracing.capture import Traced

__all__ = ["CastForLoad", "PlanningCast", "cast_floating", "warn_computed_cast", "warn_uncast"]

_Traced = TypeVar("_Traced")


def _castable(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.dtype]]:
    """``(tensor, dtype to cast it to)`` for each floating parameter and persistent buffer of ``model`` (each
    tensor once) not yet at the dtype a split at ``dtype`` holds it: ``dtype``, or the one the model keeps it at
    (:mod:`fxsplit.cost.keptdtype`: a MoE router's float32 gate)."""
    computed = {id(buffer) for buffer in _computed_buffers(model)}  # kept at their dtype (but see _computed_too)
    kept = kept_tensors(model, dtype)  # (and computed ones named: of the dtype a model built at the dtype makes)
    seen: set[int] = set()
    found = []
    for _, tensor, _ in named_tensors(model):
        if id(tensor) in seen or (id(tensor) in computed and id(tensor) not in kept) or not tensor.is_floating_point():
            continue
        seen.add(id(tensor))
        target = kept.get(id(tensor), dtype)
        if tensor.dtype != target:
            found.append((tensor, target))
    return found


def _computed_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The non-persistent buffers of ``model``: the model computes them (no checkpoint holds them)."""
    return [
        buffer
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name in module._non_persistent_buffers_set
    ]


def _computed_too(model: torch.nn.Module, graph: torch.fx.GraphModule, dtype: torch.dtype) -> list[torch.Tensor]:
    """The computed buffers of ``model`` kept at their dtype that its cast ``graph`` needs at ``dtype``."""
    kept = kept_buffers(model, dtype)
    return list({id(kept[name]): kept[name] for name in meeting_buffers(graph, set(kept), dtype)}.values())


def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Give every floating parameter and persistent buffer of ``model`` the ``dtype`` (or the one the model keeps
    it at: :mod:`fxsplit.cost.keptdtype`); returns what undoes it."""
    return _cast(_castable(model, dtype), model)


def _cast(tensors: list[tuple[torch.Tensor, torch.dtype]], model: torch.nn.Module) -> Callable[[], None]:
    """Give each of ``tensors`` (of ``model``) its dtype; returns what undoes it. Each keeps its object, but a
    view (a buffer registered as ``table.float().unsqueeze(0)``: diffusers' patch embeddings), which given new data
    would keep its base at the old dtype (torch's fake tensors refuse that): the modules get a cast copy of it."""
    changed: list[tuple[torch.Tensor, torch.Tensor]] = []
    views: dict[int, torch.Tensor] = {}
    for tensor, dtype in tensors:
        if tensor._base is not None:
            copy = tensor.detach().to(dtype)
            parameter = isinstance(tensor, torch.nn.Parameter)
            views[id(tensor)] = torch.nn.Parameter(copy, tensor.requires_grad) if parameter else copy
        else:
            changed.append((tensor, tensor.data))
            tensor.data = tensor.data.to(dtype)
    replaced: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    if views:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is not None and id(value) in views:
                        replaced.append((table, name, value))
        for table, name, value in replaced:
            table[name] = views[id(value)]  # type: ignore[assignment]  # (a parameter's view is made a Parameter)
        forget_walk(model)

    def undo() -> None:
        for tensor, data in changed:
            tensor.data = data
        for table, name, value in reversed(replaced):
            table[name] = value
        if replaced:
            forget_walk(model)

    return undo


class CastForLoad:
    """``with CastForLoad(model, loads) as cast:`` ... ``cast(dtype)`` casts ``model`` (when ``loads``: a
    checkpoint will fill it) to the plan's dtype once it is known, and says whether it did: then the model holds
    what the split will hold, and its trace the dtypes the split runs at. The cast is undone if the block fails."""

    def __init__(self, model: torch.nn.Module, loads: bool) -> None:
        self.model = model
        self.loads = loads
        self.undo: list[Callable[[], None]] = []
        self.dtype: torch.dtype | None = None

    def __call__(self, dtype: str | None) -> bool:
        if self.loads and dtype:
            self.dtype = getattr(torch, dtype)
            self.undo.append(cast_floating(self.model, self.dtype))
            return True
        return False

    def traced(self, trace: Callable[[], _Traced], traced_of: Callable[[_Traced], Traced]) -> _Traced:
        """``trace()`` of the model as cast (``traced_of``: its :class:`Traced` in what it returns); again after
        casting the computed buffers its graph shows are
        needed at the dtype (:mod:`fxsplit.checkpoint.computed`), when there are such. A model that does not
        trace with its computed buffers kept is traced with them cast (:func:`warn_computed_cast`)."""
        try:
            made = trace()
        except TraceError as error:
            if (retraced := self._with_computed_cast(trace, traced_of, str(error))) is None:
                raise
            made = retraced
        missing = traced_of(made).shapes_missing  # (torch.fx: its graph did not run on fake tensors)
        if missing and (retraced := self._with_computed_cast(trace, traced_of, str(missing))) is not None:
            made = retraced
        if self.dtype is not None and (tensors := _computed_too(self.model, traced_of(made).graph_module, self.dtype)):
            self.undo.append(_cast([(t, self.dtype) for t in tensors], self.model))
            made = trace()
        return made

    def _with_computed_cast(
        self, trace: Callable[[], _Traced], traced_of: Callable[[_Traced], Traced], why: str
    ) -> _Traced | None:
        """``trace()`` with the computed buffers cast too, when it traces so (its shapes found), else None (and
        they are put back)."""
        kept = kept_buffers(self.model, self.dtype) if self.dtype is not None else {}
        if not kept or self.dtype is None:
            return None
        undo = _cast([(t, self.dtype) for t in {id(t): t for t in kept.values()}.values()], self.model)
        try:
            made = trace()
        except TraceError:
            made = None
        if made is None or traced_of(made).shapes_missing:
            undo()
            return None
        self.undo.append(undo)
        warn_computed_cast(sorted(kept), self.dtype, why)
        return made

    def fed(
        self, tracing: Callable[[Any, Any], _Traced], inputs: tuple[Any, Any], traced_of: Callable[[_Traced], Traced]
    ) -> tuple[_Traced, tuple[Any, Any]]:
        """:meth:`traced` of ``tracing`` on the example inputs ``(positional, keyword)`` as given, or at the dtype
        (:func:`~fxsplit.checkpoint.fed.traced_as_fed`), and the inputs it was traced on."""
        fed = inputs

        def trace() -> _Traced:
            nonlocal fed
            if self.dtype is None:
                return tracing(*inputs)
            made, fed = traced_as_fed(tracing, inputs, self.dtype, lambda made: traced_of(made).graph_module)
            return made

        return self.traced(trace, traced_of), fed

    def __enter__(self) -> CastForLoad:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        if error is not None:  # a failed call leaves the model as it was
            for undo in reversed(self.undo):
                undo()


class PlanningCast:
    """``fxsplit.plan(model, dtype=...)``: the model as it will run at the planned dtype, while it is traced and
    planned, :meth:`undo` after. The graph is then the one a split of the model at that dtype runs, and the plan
    counts its tensors as traced (:class:`CastForLoad` does the same with a checkpoint): a bf16 Llama's attention
    softmax and norms compute in float32, tensors a plan of the float32 model counted as bf16, at half their size.

    A model whose parameters are on ``meta`` is cast (free: no data; real buffers, as ``fxsplit.empty_weights()``
    keeps them, are copied). In a model with real floating parameters, empty meta tensors of the dtype stand in
    for its parameters and buffers (:mod:`fxsplit.checkpoint.standin`; nothing is copied); not with
    ``profile=True``, which runs the ops (``stand_in=False``): that plan counts floating tensors as ``dtype``.
    Floating example inputs are given or at the dtype, as the model can be fed (:mod:`fxsplit.checkpoint.fed`).

    Attributes:
        cast: the model holds the planned dtype (cast here, or already so): count its tensors as traced.
        given: the model's structure before the cast (:func:`~fxsplit.planning.fingerprint.describe`), which the
            plan records, so that it applies to the model as given; None when nothing was cast.
        inputs: the example inputs traced and planned with: ``(positional, keyword)``, as given or at the dtype.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: str | None,
        inputs: tuple[Any, Any] = (None, None),
        *,
        stand_in: bool = True,
    ) -> None:
        from fxsplit.planning.fingerprint import describe

        self.dtype = dtype
        self.cast = False
        self.given: Structure | None = None
        self.inputs = self._as_given = inputs
        self._fed = any(given is not None for given in inputs)
        self._undo: Callable[[], None] | None = None
        self._model, self._stood_in = model, False
        self._dtype: torch.dtype | None = getattr(torch, dtype) if dtype else None
        if not dtype:
            return
        target = getattr(torch, dtype)
        tensors = _castable(model, target)
        parameters = [t for t, _ in tensors if isinstance(t, torch.nn.Parameter)]
        if tensors and all(t.is_meta for t in parameters):  # real buffers are cast too (copied, put back after)
            self.given = describe(model)
            self._undo = _cast(tensors, model)
        elif parameters and stand_in and self._fed:  # without inputs there are no activations to count
            given = describe(model)
            self._undo = standin.stand_in(model, target)
            if self._undo is not None:
                self.given, self._stood_in = given, True
        self.cast = not tensors or self._undo is not None

    @property
    def fed_at_dtype(self) -> bool:
        """The model was traced on its floating inputs at the dtype (:func:`~fxsplit.checkpoint.fed.traced_as_fed`)."""
        return self.inputs is not self._as_given

    def undo(self) -> None:
        """Put the model's dtypes back (again: nothing)."""
        if self._undo is not None:
            self._undo()
            self._undo = None

    def traced(self, tracing: Callable[[Any, Any], Traced]) -> Traced:
        """``tracing(*self.inputs)`` of the model as it is now; when the cast model fails to trace, or (torch.fx)
        its shapes cannot be found (an op the dtype or ``meta`` does not support), the cast is undone, with a
        warning that the plan counts floating tensors as the dtype, and the model as given is traced on the
        inputs as given. Computed buffers the cast graph needs at the dtype are cast too, and the model traced
        again (:mod:`fxsplit.checkpoint.computed`)."""
        made = self._traced(tracing)
        if self._undo is not None and self._dtype is not None:  # computed buffers the cast model needs at the dtype
            names = meeting_buffers(made.graph_module, set(kept_buffers(self._model, self._dtype)), self._dtype)
            if names:
                self._cast_too(names)
                made = self._traced(tracing)
        return made

    def _traced(self, tracing: Callable[[Any, Any], Traced]) -> Traced:
        try:
            if self._undo is not None and self._dtype is not None:  # the inputs as given, or at the dtype
                made, self.inputs = traced_as_fed(tracing, self._as_given, self._dtype, _graph_of)
            else:
                made = tracing(*self.inputs)
        except TraceError as error:
            retraced = self._with_computed_cast(tracing, str(error))
            if retraced is None:
                why = self._undo_cast(str(error))
                if why is None:
                    raise
                return self._warned(tracing(*self.inputs), why)  # a model that fails as given too: its error alone
            made = retraced
        missing = getattr(made, "shapes_missing", None)  # (expected without inputs: the cast weights still count)
        if missing and self._fed:
            if (retraced := self._with_computed_cast(tracing, str(missing))) is not None:
                return retraced
            if (why := self._undo_cast(str(missing))) is not None:
                return self._warned(tracing(*self.inputs), why)
        return made

    def _with_computed_cast(self, tracing: Callable[[Any, Any], Traced], why: str) -> Traced | None:
        """The cast model traced with its computed buffers cast too, when it failed with them kept (None: it has
        none, or fails so too: its dtypes are then put back by the caller, these buffers' included)."""
        if self._undo is None or self._dtype is None or not (kept := sorted(kept_buffers(self._model, self._dtype))):
            return None
        self._cast_too(kept)
        try:
            made, self.inputs = traced_as_fed(tracing, self._as_given, self._dtype, _graph_of)
        except TraceError:
            return None
        if self._fed and getattr(made, "shapes_missing", None):
            return None
        warn_computed_cast(kept, self._dtype, why)
        return made

    def _cast_too(self, names: list[str]) -> None:
        """Cast the computed buffers ``names`` to the dtype as well (stood in for again, or cast)."""
        assert self._undo is not None and self._dtype is not None
        if self._stood_in:
            self._undo()
            self._undo = standin.stand_in(self._model, self._dtype, cast_too=names)  # (it stood in before: it can)
            return
        kept = kept_buffers(self._model, self._dtype)
        more = _cast([(t, self._dtype) for t in {id(kept[n]): kept[n] for n in names}.values()], self._model)
        earlier = self._undo

        def undo() -> None:
            more()
            earlier()

        self._undo = undo

    def _undo_cast(self, said: str) -> str | None:
        """Undo the cast and say why, for the warning once the model as given traces (None: there was none)."""
        if self._undo is None:
            return None
        self.undo()
        self.cast, self.given, self.inputs = False, None, self._as_given
        return said.strip().splitlines()[0] if said.strip() else "no reason given"

    def _warned(self, made: Traced, why: str) -> Traced:
        """``made``, the trace of the model as given, with the warning that its floats count as the dtype."""
        warnings.warn(
            FxsplitWarning(
                f"the model cast to {self.dtype} could not be traced ({why}); it was traced at its own dtypes and "
                f"its floating tensors are counted as {self.dtype}, so work the {self.dtype} model does at another "
                f"dtype (a float32 softmax, norm or loss) is counted as {self.dtype}; to plan the model as it will "
                f"run, cast it and its floating inputs to {self.dtype} yourself (model.to(torch.{self.dtype}))"
            ),
            stacklevel=user_stacklevel(),
        )
        return made


def warn_computed_cast(names: list[str], dtype: torch.dtype, why: str) -> None:
    """Say that the computed buffers ``names`` were cast to ``dtype``, as the model did not trace with them kept
    at their own (``why``): a mask made at the default dtype (OpenAI-GPT's causal ``bias``, float32 in a model
    built at float32, bf16 in one ``from_pretrained`` builds at bf16) meets the cast activations."""
    shown = ", ".join(repr(name) for name in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    first = why.strip().splitlines()[0] if why.strip() else "no reason given"
    kind = str(dtype).removeprefix("torch.")
    warnings.warn(
        FxsplitWarning(
            f"the model cast to {kind} traced only with its computed (non-persistent) buffers at {kind} too, so "
            f"{shown} were cast ({first}); a model built at {kind} (transformers' from_pretrained(dtype=...)) makes "
            f"them so, but a table it means to keep at float32 (a rotary table) now rounds at {kind}: build the "
            "model at the dtype to keep the dtypes its code gives them"
        ),
        stacklevel=user_stacklevel(),
    )


def warn_uncast(model: torch.nn.Module, dtype: str | None) -> None:
    """Warn when a split without a checkpoint keeps floating tensors at another dtype than the plan counted:
    their bytes on the devices are not those the budgets were checked against."""
    if not dtype:
        return
    planned = getattr(torch, dtype)
    computed = {id(t) for t in _computed_buffers(model)}  # a rotary table: kept at its dtype, and planned so
    computed |= set(kept_tensors(model, planned))  # a router gate the plan counts at float32: a few bytes off at most
    held = {
        t.dtype
        for _, t, _ in named_tensors(model)
        if t.is_floating_point() and t.dtype != planned and id(t) not in computed
    }
    if held:
        found = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
        warnings.warn(
            FxsplitWarning(
                f"the plan counts floating weights as {dtype}, but the model's are {found} and are moved as they "
                f"are, so devices hold other bytes than the budgets were checked for; cast the model first "
                f"(model.to(torch.{dtype})) or pass checkpoint= to load it as {dtype}"
            ),
            stacklevel=user_stacklevel(),
        )


def _graph_of(made: Traced) -> torch.fx.GraphModule:
    return made.graph_module
