"""A readable view of a split's generated code: one section per device, weights read where they are used.

``gm.code`` is what runs, and it is written for Python, not for people: a torch.export split opens with
pytree plumbing, an input check and one line per weight, and every line ends by freeing the values it
was the last to use. :func:`show_code` prints the same statements in the same order, but

* a comment line ``# ---- cpu:1 ----`` wherever the device that runs the next line changes;
* each weight read just before its first use (with ``# on cpu:0`` where it lives elsewhere and is copied);
* the input flattening, export's input check (``_guards_fn``) and the ``= None`` frees folded away;
* the output packing shown as the plain values returned.

It only rearranges lines of ``gm.code``; print ``gm.code`` for the exact program.
"""

from __future__ import annotations

import re

import torch.fx

from fxsplit.codegen.meta import DEVICE_META

__all__ = ["show_code"]

_ASSIGNED = re.compile(r"^    (\w+) = ")
_FREES = re.compile(r";  (?:\w+ = )+None$")
_UNFLATTEN = re.compile(r"^    return pytree\.tree_unflatten\((.*), self\._out_spec\)$")
_FOLDED_PREFIXES = ("fx_pytree.tree_flatten_spec(",)
_HEADER = "# fxsplit: readable view of gm.code (same statements; print(gm.code) for the exact program)"


def show_code(split: torch.fx.GraphModule) -> str:
    """The generated ``forward`` of ``split``, arranged for reading (see the module docstring).

    Args:
        split: a module returned by :func:`fxsplit.fxsplit` or :func:`fxsplit.apply` (a pipeline's
            ``stages[i]`` works too).

    Example:
        >>> import torch, fxsplit
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        >>> gm = fxsplit.fxsplit(model, {"cpu:0": "300KiB", "cpu:1": "300KiB"},
        ...                      example_inputs=(torch.randn(2, 256),), trace="fx")
        >>> print(fxsplit.show_code(gm))
        # fxsplit: readable view of gm.code (same statements; print(gm.code) for the exact program)
        def forward(self, input):
            input_1 = input
            # ---- cpu:0 ----
            to = input_1.to('cpu:0')
            _0 = getattr(self, "0")(to)
            _1 = getattr(self, "1")(_0)
            # ---- cpu:1 ----
            to_1 = _1.to('cpu:1')
            _2 = getattr(self, "2")(to_1)
            return _2
    """
    nodes = {node.name: node for node in split.graph.nodes}
    body = [line for line in split.code.splitlines() if line.strip()]
    reads, statements = _weight_reads(body, nodes)
    out = [_HEADER]
    current: str | None = None
    for line in statements:
        name = _assigned(line)
        if name == "_guards_fn" or line.strip().split(" = ", 1)[-1].startswith(_FOLDED_PREFIXES):
            continue
        device = _device(nodes.get(name or ""))
        pending = [name_ for name_, _ in reads if _uses(line, name_)]
        if device is not None and device != current:
            out.append(f"    # ---- {device} ----")
            current = device
        for read_name in pending:
            out.append(_read_line(reads, read_name, nodes, current))
        reads = [(name_, read) for name_, read in reads if name_ not in pending]
        out.append(_readable(line))
    return "\n".join(out)


def _weight_reads(body: list[str], nodes: dict[str, torch.fx.Node]) -> tuple[list[tuple[str, str]], list[str]]:
    """``([(weight variable, its line)], the other lines)``: weight reads are re-inserted at first use."""
    reads: list[tuple[str, str]] = []
    rest: list[str] = []
    for line in body:
        name = _assigned(line)
        node = nodes.get(name or "")
        if node is not None and node.op == "get_attr":
            reads.append((name or "", line))
        else:
            rest.append(line)
    return reads, rest


def _read_line(reads: list[tuple[str, str]], name: str, nodes: dict[str, torch.fx.Node], here: str | None) -> str:
    line = _readable(dict(reads)[name])
    home = _device(nodes.get(name))
    return line if home is None or home == here else f"{line}  # on {home}"


def _assigned(line: str) -> str | None:
    match = _ASSIGNED.match(line)
    return match.group(1) if match else None


def _uses(line: str, name: str) -> bool:
    value = line.split(" = ", 1)[1] if _assigned(line) else line
    return re.search(rf"\b{re.escape(name)}\b", value) is not None


def _device(node: torch.fx.Node | None) -> str | None:
    if node is None:
        return None
    device = node.meta.get(DEVICE_META)
    return str(device) if device is not None else None


def _readable(line: str) -> str:
    line = _FREES.sub("", line)
    unflatten = _UNFLATTEN.match(line)
    if unflatten:
        values = unflatten.group(1)
        single = re.fullmatch(r"\((\w+),\)", values)
        line = f"    return {single.group(1) if single else values}"
    return line
