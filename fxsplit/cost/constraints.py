"""Pins, together-groups and leaf modules, checked against the model: every problem at once.

Each option may come from a spec file or from a keyword argument; messages
name where it came from (``specs/x.yaml:7: pin['lm_head']`` or
``pins['lm_head']``) so the user knows which line to change. When budgets fit
the model but not with its pins, :func:`explain_infeasible_pins` names the
pins that make it so.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import torch
import torch.fx

from fxsplit.cost.build import path_matches
from fxsplit.errors import BudgetError, SpecError
from fxsplit.gcpause import gc_paused
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.solve import partition
from fxsplit.spec import Spec
from fxsplit.tracing.graphinfo import module_path
from fxsplit.units import format_size
from fxsplit.yamlfile import format_path

__all__ = [
    "Locate",
    "check_constraints",
    "explain_infeasible_pins",
    "locator",
    "placing_nothing",
    "resolve_leaf_modules",
    "together_groups",
]

Locate = Callable[..., str]
_SPEC_KEYS = {"pins": "pin"}


def locator(spec: Spec | None, explicit: Collection[str]) -> Locate:
    """``locate("pins", "lm_head")`` -> where that entry was written, for messages."""

    def locate(option: str, *rest: Any) -> str:
        if spec is not None and option not in explicit:
            return spec.locate((_SPEC_KEYS.get(option, option), *rest))
        return format_path((option, *rest))

    return locate


def _raise(problems: list[str], what: str) -> None:
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        raise SpecError(f"{count} with the {what}:\n  " + "\n  ".join(problems))


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def resolve_leaf_modules(model: torch.nn.Module, leaves: Iterable[type | str], locate: Locate) -> list[type | str]:
    """Leaf modules as fx wants them: module paths stay strings, class names become classes.

    A string is a module path of ``model`` (``encoder.attn``) or the name of a
    module class used in it (``MyBlock``, ``torch.nn.MultiheadAttention``).

    Raises:
        SpecError: names that are neither, each with close names.
    """
    leaves = list(leaves)
    if not leaves:
        return []
    paths = {name for name, _ in model.named_modules() if name}
    classes: dict[str, type] = {}
    for _, module in model.named_modules():
        kind = type(module)
        for alias in (kind.__name__, kind.__qualname__, f"{kind.__module__}.{kind.__qualname__}"):
            classes.setdefault(alias, kind)
    resolved: list[type | str] = []
    problems = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, str) or leaf in paths:
            resolved.append(leaf)
        elif leaf in classes or leaf.replace("torch.nn.modules.", "torch.nn.") in _short(classes):
            resolved.append(classes.get(leaf) or _short(classes)[leaf.replace("torch.nn.modules.", "torch.nn.")])
        else:
            problems.append(
                f"{locate('leaf_modules', index)}: {leaf!r} is neither a module path of the model nor "
                f"the class of one of its modules{_suggest(leaf, [*paths, *classes])}"
            )
    _raise(problems, "leaf modules")
    return resolved


def _short(classes: dict[str, type]) -> dict[str, type]:
    """``torch.nn.Linear`` for ``torch.nn.modules.linear.Linear``."""
    found = {}
    for kind in classes.values():
        if kind.__module__.startswith("torch.nn.modules"):
            found[f"torch.nn.{kind.__qualname__}"] = kind
    return found


def together_groups(together: Any) -> list[tuple[str, ...]]:
    """``together`` as a list of groups of module patterns, checking its shape.

    Raises:
        SpecError: not a list of lists of strings.
    """
    example = "like [['model.norm', 'lm_head']]"
    if isinstance(together, (str, bytes)) or not isinstance(together, Iterable):
        raise SpecError(f"together must be a list of groups of module paths or globs, {example} (got {together!r})")
    groups = []
    for group in together:
        if isinstance(group, str) or not isinstance(group, Iterable):
            raise SpecError(f"each together-group must be a list of module paths or globs, {example} (got {group!r})")
        items = tuple(group)
        if not items or not all(isinstance(item, str) and item for item in items):
            raise SpecError(f"a together-group must list module paths or globs as strings, {example} (got {items!r})")
        groups.append(items)
    return groups


def _ops(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in graph_module.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def _hits(pattern: str, ops: list[torch.fx.Node], labels: list[str]) -> list[int]:
    return [i for i, node in enumerate(ops) if path_matches(pattern, labels[i]) or node.name == pattern]


def placing_nothing(graph_module: torch.fx.GraphModule, model: torch.nn.Module, pins: Mapping[str, str]) -> set[str]:
    """The pins whose modules run no op of the graph and hold no parameter or buffer: an ``nn.Identity``, a
    dropout export left out (timm's ``patch_drop``, ``fc_norm``). There is nothing of them to place, so such a pin
    says nothing; a pattern that names no module at all is still an error (:func:`check_constraints`)."""
    ops = _ops(graph_module)
    labels = [module_path(n) for n in ops]
    modules = dict(model.named_modules())
    found = set()
    for pattern in pins:
        named = [m for path, m in modules.items() if path and path_matches(pattern, path)]
        holds = any(next(m.parameters(), None) is not None or next(m.buffers(), None) is not None for m in named)
        if named and not holds and not _hits(pattern, ops, labels):
            found.add(pattern)
    return found


def _no_match(pattern: str, model: torch.nn.Module) -> str:
    paths = [name for name, _ in model.named_modules() if name]
    if pattern in paths:
        return (
            f"module {pattern!r} runs no op of the traced graph (is it called in forward? a module traced "
            "as part of a leaf has no ops of its own); to place its weights as an Accelerate device_map "
            "does, pass the map as device_map= (pins that place every parameter are read as one)"
        )
    tops = sorted({p.split(".")[0] for p in paths})
    hint = _suggest(pattern, _glob_candidates(pattern, paths)) or (
        f"; top-level modules: {', '.join(tops[:12])}" if tops else ""
    )
    return f"no module of the model matches {pattern!r}{hint}"


def _glob_candidates(pattern: str, paths: list[str]) -> list[str]:
    """Module paths, or for a glob, the model's paths cut to its depth with its wildcard parts kept.

    ``model.layer.*`` against ``model.layers.3.up`` gives ``model.layers.*``.
    """
    parts = pattern.split(".")
    wild = [any(c in part for c in "*?[") for part in parts]
    if not any(wild):
        return paths
    found = []
    for path in paths:
        pieces = path.split(".")
        if len(pieces) >= len(parts):
            found.append(".".join(p if w else q for p, q, w in zip(parts, pieces, wild, strict=False)))
    return list(dict.fromkeys(found))


@gc_paused()
def check_constraints(
    graph_module: torch.fx.GraphModule,
    model: torch.nn.Module,
    devices: Sequence[str],
    pins: Mapping[str, str],
    together: Sequence[Sequence[str]],
    locate: Locate,
) -> None:
    """Check pins and together-groups against the traced graph; raise once with every problem.

    Problems: a pin to a device without a budget; a pattern that matches no
    module (with close names); two pins that put one op on two devices; pins
    against the device order (devices run in the order listed); a group whose
    ops are pinned to different devices.

    Raises:
        SpecError: listing every problem, each with where it was written.
    """
    if not pins and not together:  # nothing to check
        return
    ops = _ops(graph_module)
    labels = [module_path(n) for n in ops]
    order = {d: i for i, d in enumerate(devices)}
    problems: list[str] = []
    owner: dict[int, str] = {}  # op -> first pin pattern covering it
    for pattern, device in pins.items():
        where = locate("pins", pattern)
        if device not in order:
            problems.append(f"{where}: pins to '{device}', which has no budget (devices: {', '.join(devices)})")
            continue
        hits = _hits(pattern, ops, labels)
        if not hits:
            problems.append(f"{where}: {_no_match(pattern, model)}")
        for op in hits:
            other = owner.setdefault(op, pattern)
            if other != pattern and pins[other] != device:
                problems.append(
                    f"{where}: conflicts with {locate('pins', other)}: both match "
                    f"{_label(ops, labels, op)} but pin it to '{device}' and '{pins[other]}'; "
                    "make the patterns disjoint"
                )
                break
    if problems:
        _raise(problems, "pins")
    problems += _order_problems(ops, labels, owner, pins, order, locate)
    for index, group in enumerate(together):
        members: list[int] = []
        for item, pattern in enumerate(group):
            hits = _hits(pattern, ops, labels)
            if not hits:
                problems.append(f"{locate('together', index, item)}: {_no_match(pattern, model)}")
            members += hits
        if members:
            span = range(min(members), max(members) + 1)
            pinned = sorted({pins[owner[op]] for op in span if op in owner}, key=order.__getitem__)
            if len(pinned) > 1:
                names = sorted({owner[op] for op in span if op in owner})
                problems.append(
                    f"{locate('together', index)}: its ops must share a device, but pins "
                    f"{', '.join(repr(n) for n in names)} put some of them on {' and '.join(pinned)}"
                )
    _raise(problems, "pins and together-groups")


def _label(ops: list[torch.fx.Node], labels: list[str], op: int) -> str:
    return f"op '{ops[op].name}'" + (f" (in '{labels[op]}')" if labels[op] else "")


def _order_problems(
    ops: list[torch.fx.Node],
    labels: list[str],
    owner: dict[int, str],
    pins: Mapping[str, str],
    order: dict[str, int],
    locate: Locate,
) -> list[str]:
    problems: list[str] = []
    latest: tuple[int, str] | None = None  # (op, pattern) pinned to the latest device so far
    reported: set[tuple[str, str]] = set()
    for op in sorted(owner):
        pattern = owner[op]
        if latest is not None and order[pins[pattern]] < order[pins[latest[1]]]:
            if (pattern, latest[1]) not in reported:
                reported.add((pattern, latest[1]))
                problems.append(
                    f"{locate('pins', pattern)}: pins {_label(ops, labels, op)} to '{pins[pattern]}', but it runs "
                    f"after {_label(ops, labels, latest[0])}, pinned to the later stage '{pins[latest[1]]}' by "
                    f"{locate('pins', latest[1])}; devices run in the order the budgets list them: reorder the "
                    "devices or change a pin"
                )
        else:
            latest = (op, pattern)
    return problems


def explain_infeasible_pins(
    error: BudgetError,
    problem: PartitionProblem,
    budgets: Sequence[int],
    devices: Sequence[str],
    pins: Mapping[str, str],
    extra_groups: int,
    locate: Locate,
    *,
    contiguous: bool = False,
) -> BudgetError | None:
    """A BudgetError naming the pins and groups, when the budgets fit without them; else None.

    ``extra_groups`` is how many of ``problem.together`` came from the user
    (they come last); the others are in-place writes, which always stay.
    Names the single pins or groups whose removal alone makes it fit.
    ``contiguous``: whether the placement must keep stage order, as the
    partition that failed did (a model may fit out of order but not in it).
    """
    if not problem.pinned and not extra_groups:
        return None
    keep = problem.together[: len(problem.together) - extra_groups]
    labels = list(problem.op_labels) or [""] * problem.num_ops
    ops_of = {
        p: {op for op in problem.pinned if path_matches(p, labels[op]) or problem.op_names[op] == p} for p in pins
    }
    constraints: list[tuple[str, PartitionProblem]] = []
    for pattern, device in pins.items():
        pinned = {op: d for op, d in problem.pinned.items() if op not in ops_of[pattern]}
        constraints.append((f"{locate('pins', pattern)} -> '{device}'", dataclasses.replace(problem, pinned=pinned)))
    for i in range(extra_groups):
        groups = problem.together[: len(keep) + i] + problem.together[len(keep) + i + 1 :]
        constraints.append((locate("together", i), dataclasses.replace(problem, together=groups)))
    if not _fits(dataclasses.replace(problem, pinned={}, together=keep), budgets, devices, contiguous):
        return None
    culprits = [name for name, relaxed in constraints[:16] if _fits(relaxed, budgets, devices, contiguous)]
    detail = _forced_spans(problem, budgets, devices)
    if culprits:
        what = (
            f"it fits without {culprits[0]}"
            if len(culprits) == 1
            else (f"it fits without any one of {'; '.join(culprits)}")
        )
    else:
        what = f"it fits only without several of them ({'; '.join(name for name, _ in constraints)})"
    return BudgetError(
        f"the budgets fit the model, but not with its pins and together-groups: {what}. {detail}"
        f"Change or drop it, or raise the budgets. ({error})"
    )


def _fits(problem: PartitionProblem, budgets: Sequence[int], devices: Sequence[str], contiguous: bool) -> bool:
    try:
        partition(problem, budgets, device_names=list(devices), contiguous=contiguous)
    except (BudgetError, SpecError):
        return False
    return True


def _forced_spans(problem: PartitionProblem, budgets: Sequence[int], devices: Sequence[str]) -> str:
    """Why: a device whose pinned ops leave too little room for them, or for what runs before or after them."""
    weights = problem.op_weights()
    total = sum(weights)
    for k, device in enumerate(devices):
        ops = sorted(op for op, d in problem.pinned.items() if d == k)
        if not ops:
            continue
        lo, hi = ops[0], ops[-1]
        span = sum(weights[lo : hi + 1])
        before, after = sum(weights[:lo]), total - span - sum(weights[:lo])
        room_before = sum(budgets[:k]) + budgets[k] - span
        room_after = sum(budgets[k + 1 :]) + budgets[k] - span
        if span > budgets[k]:
            return (
                f"The ops pinned to '{device}', from {problem.label(lo)} to {problem.label(hi)}, and all ops "
                f"between them need {format_size(span)}, more than its budget {format_size(budgets[k])}. "
            )
        if before > room_before:
            return (
                f"Everything before {problem.label(lo)} (pinned to '{device}') needs {format_size(before)}, but "
                f"'{device}' and the devices before it have {format_size(room_before)} left. "
            )
        if after > room_after:
            return (
                f"Everything after {problem.label(hi)} (pinned to '{device}') needs {format_size(after)}, but "
                f"'{device}' and the devices after it have {format_size(room_after)} left. "
            )
    return ""


def refuse_split_writes(problem: PartitionProblem, devices: Sequence[str]) -> None:
    """Refuse pins that put ops writing one tensor in place on two devices: a write made on a copy of the
    tensor would not reach it (the partitioner could only say that nothing fits).

    Raises:
        SpecError: naming the ops, their modules and the devices they are pinned to.
    """
    labels = list(problem.op_labels) or [""] * problem.num_ops
    for group in problem.colocated:
        pinned = {op: problem.pinned[op] for op in group if op in problem.pinned}
        if len(set(pinned.values())) > 1:
            where = ", ".join(
                f"'{problem.op_names[op]}'" + (f" (in '{labels[op]}')" if labels[op] else "") + f" on '{devices[d]}'"
                for op, d in pinned.items()
            )
            raise SpecError(
                f"pins put ops that write one tensor in place (or make a view of it that is written) on two "
                f"devices: {where}; a write on another device would change a copy, not the tensor: pin them to "
                "one device, or drop one of those pins"
            )
