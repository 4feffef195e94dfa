"""Draw a split: the graph with nodes coloured by device, cut edges labelled with bytes,
and a per-device memory bar chart.

Needs the optional ``graphviz`` Python package (``pip install graphviz`` or
``pip install fxsplit[viz]``); rendering SVG or PNG also needs Graphviz's
``dot`` program (Debian/Ubuntu: ``apt-get install graphviz``). Writing a
``.dot`` file needs only the Python package. Both are imported lazily: fxsplit
works without them and says how to install them when asked to draw.

Big graphs are drawn by module: with ``depth=N`` consecutive ops of the same
module (path cut to N parts) on the same device become one box.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import torch.fx

from fxsplit.errors import FxsplitError
from fxsplit.planning.plan import Plan
from fxsplit.tracing.graphinfo import module_path
from fxsplit.units import format_size

__all__ = ["INSTALL_HINT", "auto_depth", "render", "to_dot"]

INSTALL_HINT = (
    "drawing needs the graphviz Python package: pip install graphviz (or pip install 'fxsplit[viz]'); "
    "rendering SVG/PNG also needs the Graphviz 'dot' program: apt-get install graphviz on Debian/Ubuntu "
    "(brew install graphviz on macOS); a .dot file needs only the Python package"
)
PALETTE = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#ffffb3", "#bc80bd", "#ccebc5")
FORMATS = ("svg", "png", "pdf", "dot")


def _graphviz() -> Any:
    try:
        import graphviz
    except ImportError:
        raise FxsplitError(INSTALL_HINT) from None
    return graphviz


def _groups(graph_module: torch.fx.GraphModule, plan: Plan, depth: int | None) -> tuple[dict[str, int], list[dict]]:
    """Node name -> group index, and groups ``{device, label, nodes}`` in graph order."""
    of: dict[str, int] = {}
    groups: list[dict[str, Any]] = []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" or _is_input_check(node):
            continue
        device = plan.placement.get(node.name, "?")
        path = module_path(node)
        key = ".".join(path.split(".")[:depth]) if depth and path and node.op not in ("placeholder", "output") else None
        last = groups[-1] if groups else None
        if key is not None and last is not None and last["key"] == key and last["device"] == device:
            last["nodes"].append(node)
        else:
            groups.append({"key": key, "device": device, "nodes": [node]})
        of[node.name] = len(groups) - 1
    return of, groups


def _is_input_check(node: torch.fx.Node) -> bool:
    """torch.export's check of the inputs (``_guards_fn``): plumbing, not a step of the model."""
    return node.op == "call_module" and str(node.target) == "_guards_fn"


def auto_depth(graph_module: torch.fx.GraphModule, plan: Plan, limit: int = 60) -> int | None:
    """None (every node) when the graph is small, else the deepest module level that stays under ``limit`` boxes."""
    if len(_groups(graph_module, plan, None)[1]) <= limit:
        return None
    best = 1
    for depth in range(1, 8):
        if len(_groups(graph_module, plan, depth)[1]) <= limit:
            best = depth
    return best


def to_dot(graph_module: torch.fx.GraphModule, plan: Plan, *, depth: int | None = None, title: str = "") -> Any:
    """A ``graphviz.Digraph`` of the split: one cluster per device, cut edges in red with their bytes.

    Raises:
        FxsplitError: the graphviz package is missing; the message says how to install it.
    """
    graphviz = _graphviz()
    colour = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(plan.devices)}
    dot = graphviz.Digraph(
        "fxsplit",
        graph_attr={"rankdir": "TB", "fontname": "Helvetica", "label": title, "labelloc": "t", "newrank": "true"},
        node_attr={"fontname": "Helvetica", "fontsize": "10", "style": "filled"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9", "color": "#555555"},
    )
    dot.node("memory", label=_memory_table(plan, colour), shape="plaintext", style="")
    of, groups = _groups(graph_module, plan, depth)
    for index, device in enumerate(plan.devices):
        with dot.subgraph(name=f"cluster_{index}") as cluster:
            cluster.attr(label=device, style="rounded,dashed", color=colour[device], fontsize="12")
            for number, group in enumerate(groups):
                if group["device"] == device:
                    cluster.node(f"g{number}", **_box(group, colour[device]))
    for number, group in enumerate(groups):
        if group["device"] not in colour:
            dot.node(f"g{number}", **_box(group, "#ffffff"))
    if groups:
        dot.edge("memory", "g0", style="invis")
    cut_bytes = {(c.producer, c.destination): c.nbytes for c in plan.cuts}
    edges: dict[tuple[int, int], dict[str, int | None]] = {}
    for node in graph_module.graph.nodes:
        if node.name not in of:
            continue
        for arg in node.all_input_nodes:
            if arg.name in of and of[arg.name] != of[node.name]:
                moved = edges.setdefault((of[arg.name], of[node.name]), {})
                destination = plan.placement.get(node.name, "")
                if plan.placement.get(arg.name) != destination:
                    moved[arg.name] = cut_bytes.get((arg.name, destination))
    labelled: set[tuple[str, str]] = set()  # a value copied once to a device is labelled once
    for (src, dst), moved in edges.items():
        if moved:
            destination = groups[dst]["device"]
            fresh = {name: n for name, n in moved.items() if (name, destination) not in labelled}
            labelled.update((name, destination) for name in moved)
            label = _bytes_label(list(fresh.values())) if fresh else "(copied above)"
            dot.edge(f"g{src}", f"g{dst}", label=label, color="#d62728", fontcolor="#d62728", penwidth="2")
        else:
            dot.edge(f"g{src}", f"g{dst}")
    for cut in plan.cuts:
        if cut.kind == "parameter":
            ends = _weight_readers(graph_module, plan, cut, of)
            if ends is not None:
                dot.edge(
                    f"g{ends[0]}",
                    f"g{ends[1]}",
                    label=f"{format_size(cut.nbytes)} ({cut.producer})",
                    style="dashed",
                    color="#d62728",
                    fontcolor="#d62728",
                    constraint="false",
                )
    return dot


def _bytes_label(moved: list[int | None]) -> str:
    known = [m for m in moved if m is not None]
    return format_size(sum(known)) if len(known) == len(moved) else "size unknown"


def _weight_readers(
    graph_module: torch.fx.GraphModule, plan: Plan, cut: Any, of: dict[str, int]
) -> tuple[int, int] | None:
    """Groups reading a copied weight: one on its home device, one on the destination."""
    names = next((set(g) for g in plan.tied if cut.producer in g), {cut.producer})
    modules = {name.rpartition(".")[0] for name in names}
    readers: list[torch.fx.Node] = []
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and str(node.target) in names:
            readers.extend(u for u in node.users if u.name in of)
        elif node.op == "call_module" and str(node.target) in modules and node.name in of:
            readers.append(node)
    home = [of[n.name] for n in readers if plan.placement.get(n.name) == cut.source]
    away = [of[n.name] for n in readers if plan.placement.get(n.name) == cut.destination]
    return (home[0], away[0]) if home and away else None


def _box(group: dict[str, Any], fill: str) -> dict[str, str]:
    nodes = group["nodes"]
    first = nodes[0]
    if first.op == "placeholder":
        return {"label": first.name, "shape": "ellipse", "fillcolor": fill}
    if first.op == "output":
        return {"label": "output", "shape": "doubleoctagon", "fillcolor": fill}
    if len(nodes) == 1:
        path = module_path(first)
        label = f"{first.name}\\n{path}" if path and path != first.name else first.name
    else:
        label = f"{group['key']}\\n{len(nodes)} ops"
    return {"label": label, "shape": "box", "fillcolor": fill}


def _memory_table(plan: Plan, colour: dict[str, str], width: int = 240) -> str:
    """An HTML-like label: one bar per device (used | free | reserved), plus copies of tied tensors."""
    rows = ['<TR><TD COLSPAN="3" ALIGN="LEFT"><B>memory per device (parameters and buffers)</B></TD></TR>']
    for device in plan.devices:
        budget = plan.budgets.get(device, 0) or 1
        used, reserved = plan.device_bytes.get(device, 0), plan.reserved.get(device, 0)
        cells = []
        free = max(budget - used - reserved, 0)
        for amount, fill in ((used, colour[device]), (free, "#eeeeee"), (reserved, "#999999")):
            pixels = round(width * min(amount, budget) / budget)
            if pixels > 0:
                cells.append(f'<TD WIDTH="{pixels}" HEIGHT="14" FIXEDSIZE="TRUE" BGCOLOR="{fill}"></TD>')
        bar = f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0"><TR>{"".join(cells) or "<TD></TD>"}</TR></TABLE>'
        share = f"{100 * used / budget:.1f}%"
        text = f"{format_size(used)} / {format_size(plan.budgets.get(device, 0))} ({share})"
        if reserved:
            text += f", {format_size(reserved)} reserved"
        rows.append(f'<TR><TD ALIGN="LEFT">{html.escape(device)}</TD><TD>{bar}</TD><TD ALIGN="LEFT">{text}</TD></TR>')
    transfer = f"{len(plan.cuts)} cuts, {format_size(plan.transfer_bytes)} copied per forward"
    rows.append(f'<TR><TD COLSPAN="3" ALIGN="LEFT">{transfer}; outputs on {html.escape(plan.output_device)}</TD></TR>')
    for line in plan.tied_summary():
        rows.append(f'<TR><TD COLSPAN="3" ALIGN="LEFT">{html.escape(line)}</TD></TR>')
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2">' + "".join(rows) + "</TABLE>>"


def render(
    graph_module: torch.fx.GraphModule, plan: Plan, path: str | Path, *, depth: int | None = None, title: str = ""
) -> Path:
    """Draw the split into ``path``; the format comes from its suffix (.svg, .png, .pdf or .dot).

    Raises:
        FxsplitError: an unknown suffix, or graphviz (package or ``dot``) missing, with the install hint.
    """
    target = Path(path)
    suffix = target.suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise FxsplitError(
            f"cannot tell the picture format from '{target}'; end the name in {', '.join('.' + f for f in FORMATS)}"
        )
    dot = to_dot(graph_module, plan, depth=depth, title=title)
    if suffix == "dot":
        target.write_text(dot.source, encoding="utf-8")
        return target
    graphviz = _graphviz()
    try:
        data = dot.pipe(format=suffix)
    except graphviz.ExecutableNotFound:
        raise FxsplitError(
            f"cannot render '{target}': Graphviz's 'dot' program is not installed; " + INSTALL_HINT
        ) from None
    target.write_bytes(data)
    return target
