"""Drawing an FX graph for the report: backbone call regions collapsed into one box each, the nodes around them
drawn one by one, laid out by graphviz's ``dot`` where it is installed and by a small layered layout in pure Python
otherwise; the result is one self-contained SVG.
"""
from __future__ import annotations

import html
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from .passes.graph import op_packet
from .passes.meta import CALL, INPUT, PROVISIONAL, Provisional

# role -> (fill, outline, legend text). Highlighted roles come first: they are what the report is about.
ROLES = {
    "inserted": ("#8fdc9b", "#1e7b34", "inserted by the rewrite (Retain: the rollout keeps the backbone output; "
                 "Reweight: the provisional backward)"),
    "reused": ("#9fcbff", "#1f5fa8", "placeholder that reads the rollout's retained backbone output"),
    "removed": ("#ffa79d", "#b3261e", "update backbone node shared with the rollout, removed by the rewrite"),
    "backbone": ("#ffdc8f", "#a86f00", "backbone call region, collapsed into one box"),
    "span": ("#e2e2e2", "#777777", "run of other nodes, collapsed (graphs without call regions)"),
    "unused": ("#f7f7f7", "#999999", "inputs no node reads, grouped"),
    "input": ("#eef2f7", "#5b6b7f", "input (placeholder)"),
    "plain": ("#ffffff", "#555555", "other aten node"),
    "output": ("#cfcfcf", "#333333", "graph output"),
}
MAX_SINGLE = 400  # beyond this many individually drawn nodes a graph's uncollapsed nodes are grouped in spans
SPAN = 60  # nodes per span
TOP_OPS = 4


# --- Boxes: what the drawing shows ------------------------------------------------------------------------


@dataclass(eq=False)  # boxes are identities: nodes map to the box that owns them
class _Box:
    key: str
    role: str
    members: list = field(default_factory=list)
    lines: list = field(default_factory=list)
    tooltip: str = ""


def _histogram(nodes) -> str:
    ops = Counter(op_packet(n) for n in nodes if n.op == "call_function")
    return "  ".join(f"{op}×{count}" for op, count in ops.most_common(TOP_OPS))


def _parameters(nodes) -> tuple[int, int]:
    """The parameter placeholders read by ``nodes``: how many, and how many scalars they hold."""
    params = {a for n in nodes for a in n.all_input_nodes if a.meta.get(INPUT, "").startswith("param:")}
    params |= {n for n in nodes if n.meta.get(INPUT, "").startswith("param:")}
    scalars = sum(p.meta["val"].numel() for p in params if isinstance(p.meta.get("val"), torch.Tensor))
    return len(params), scalars


def _region_key(node: fx.Node):
    """Nodes drawn as one box: a backbone call (by call index), or Reweight's provisional backward."""
    call = node.meta.get(CALL)
    if call is not None:
        return ("backbone", call.index)
    if node.meta.get(PROVISIONAL) not in (None, Provisional.LOSS):
        return ("provisional", 0)
    return None


def _call_regions(nodes) -> list[_Box]:
    """One box per run of consecutive nodes with the same region key."""
    boxes = []
    for node in nodes:
        key = _region_key(node)
        if key is None:
            continue
        last = boxes[-1] if boxes else None
        if last is None or last.members[-1].next is not node or _region_key(last.members[-1]) != key:
            boxes.append(_Box(f"call{len(boxes)}", "backbone" if key[0] == "backbone" else "inserted"))
        boxes[-1].members.append(node)
    return boxes


def _spans(nodes, owner, roles) -> list[_Box]:
    """Consecutive unhighlighted compute nodes outside call regions, in chunks of ``SPAN``."""
    boxes, run = [], []
    for node in nodes:
        free = node.op not in ("placeholder", "output") and node not in owner and node.name not in roles
        if free:
            run.append(node)
        if run and (not free or len(run) == SPAN):
            boxes.append(_Box(f"span{len(boxes)}", "span", run))
            run = []
    if run:
        boxes.append(_Box(f"span{len(boxes)}", "span", run))
    return boxes


def _claim(boxes, owner) -> None:
    for box in boxes:
        for node in box.members:
            owner[node] = box


def _fold_inputs(nodes, owner) -> _Box | None:
    """Inputs read only inside one box join it; inputs nobody reads form one box of their own."""
    unused = _Box("unused", "unused")
    for node in nodes:
        if node.op != "placeholder" or node in owner:
            continue
        readers = {owner.get(user) for user in node.users}
        if not node.users:
            unused.members.append(node)
        elif len(readers) == 1 and None not in readers:
            box = readers.pop()
            box.members.append(node)
            owner[node] = box
    _claim([unused], owner)
    return unused if unused.members else None


def _single(node: fx.Node, roles) -> _Box:
    if node.op == "placeholder":
        role, detail = roles.get(node.name, "input"), node.meta.get(INPUT, "placeholder")
    elif node.op == "output":
        role, detail = "output", "output"
    else:
        role, detail = roles.get(node.name, "plain"), op_packet(node)
    val = node.meta.get("val")
    shape = f" {tuple(val.shape)}" if isinstance(val, torch.Tensor) else ""
    # fx names a node after its op ("mul_66" for a mul): the op is worth a line only when the name hides it.
    obvious = node.name == detail or node.name.startswith(detail + "_")
    lines = [node.name] if obvious else [node.name, detail]
    return _Box(f"n_{node.name}", role, [node], lines, f"{node.name}: {detail}{shape}")


def _label(box: _Box, roles: dict[str, str]) -> None:
    """Title lines and a tooltip for a group box; a call region the rewrite removed from takes the removed colour."""
    nodes = box.members
    compute = [n for n in nodes if n.op != "placeholder"]
    if box.role == "backbone":
        call = compute[0].meta[CALL]
        removed = sum(roles.get(n.name) == "removed" for n in compute)
        box.role = "removed" if removed else "backbone"
        count, scalars = _parameters(nodes)
        box.lines = [f"backbone call {call.index} ({call.module})",
                     f"{len(compute)} aten nodes" + (f", {removed} removed by the rewrite" if removed else ""),
                     _histogram(compute), f"{count} parameters, {scalars:,} weights"]
    elif box.role == "inserted":
        grads = sum(n.name.startswith("provisional_grad_") for n in compute)
        box.lines = ["provisional backward (Reweight)", f"{len(compute) - grads} aten nodes", _histogram(compute),
                     f"{grads} gradient buffers out"]
    elif box.role == "span":
        inputs = len(nodes) - len(compute)
        box.lines = [f"{compute[0].name} … {compute[-1].name}",
                     f"{len(compute)} aten nodes" + (f", {inputs} inputs" if inputs else ""), _histogram(compute)]
    else:
        box.lines = [f"{len(nodes)} unused inputs", f"{nodes[0].name} … {nodes[-1].name}"]
    box.tooltip = "\n".join(box.lines)


def graph_boxes(gm: fx.GraphModule, roles: dict[str, str]) -> tuple[list[_Box], list[tuple[str, str]]]:
    """The boxes of a drawing of ``gm``, in graph order, and the edges between them."""
    nodes = list(gm.graph.nodes)
    owner: dict[fx.Node, _Box] = {}
    groups = _call_regions(nodes)
    _claim(groups, owner)
    singles = sum(n.op != "placeholder" and n not in owner for n in nodes)
    if singles > MAX_SINGLE:
        spans = _spans(nodes, owner, roles)
        _claim(spans, owner)
        groups += spans
    unused = _fold_inputs(nodes, owner)
    for box in groups + ([unused] if unused else []):
        _label(box, roles)
    boxes, seen = [], set()
    for node in nodes:
        box = owner.get(node) or _single(node, roles)
        owner[node] = box
        if box.key not in seen:
            seen.add(box.key)
            boxes.append(box)
    edges = {(owner[a].key, owner[n].key): None for n in nodes for a in n.all_input_nodes if owner[a] is not owner[n]}
    return boxes, list(edges)


# --- Layout with graphviz ---------------------------------------------------------------------------------


def _dot_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_source(boxes, edges) -> str:
    lines = ['digraph G {', 'rankdir=TB; nodesep=0.15; ranksep=0.3;',
             'node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.08,0.03"];',
             'edge [color="#888888", arrowsize=0.5];']
    for box in boxes:
        fill, outline, _ = ROLES[box.role]
        style = "rounded,filled,dashed" if box.role == "unused" else "rounded,filled"
        lines.append(f'{_dot_string(box.key)} [label={_dot_string(chr(10).join(box.lines))}, style="{style}", '
                     f'fillcolor="{fill}", color="{outline}", tooltip={_dot_string(box.tooltip or box.key)}];')
    lines += [f"{_dot_string(a)} -> {_dot_string(b)};" for a, b in edges]
    lines.append("}")
    return "\n".join(lines)


def _svg_with_dot(dot: str, boxes, edges) -> str:
    done = subprocess.run([dot, "-Tsvg"], input=dot_source(boxes, edges).encode(), capture_output=True,
                          timeout=120, check=True)
    svg = done.stdout.decode()
    return svg[svg.index("<svg"):]  # drop the XML prolog and doctype: the SVG is embedded in HTML


# --- Layout in pure Python: layers of a topological order ------------------------------------------------

CHAR_W, LINE_H, PAD, GAP_X, GAP_Y = 6.2, 13, 6, 14, 34


def _layers(boxes, edges) -> list[list[str]]:
    """Boxes in layers (longest path from the sources), inputs moved down to just above their first reader."""
    graph = nx.DiGraph()
    graph.add_nodes_from(b.key for b in boxes)
    graph.add_edges_from(edges)
    depth = {key: i for i, generation in enumerate(nx.topological_generations(graph)) for key in generation}
    for key in graph:
        if graph.in_degree(key) == 0 and graph.out_degree(key) > 0:
            depth[key] = min(depth[s] for s in graph.successors(key)) - 1
    order = {b.key: i for i, b in enumerate(boxes)}
    layers = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for key in sorted(depth, key=order.get):
        layers[depth[key]].append(key)
    return _reduce_crossings(layers, graph)


def _reduce_crossings(layers, graph, sweeps: int = 2) -> list[list[str]]:
    """Barycenter heuristic: order each layer by the mean position of its boxes' readers' inputs above."""
    for _ in range(sweeps):
        position = {}
        for layer in layers:
            def barycenter(key, fallback):
                above = [position[p] for p in graph.predecessors(key) if p in position]
                return sum(above) / len(above) if above else fallback
            layer[:] = sorted(layer, key=lambda k: barycenter(k, layer.index(k) / max(len(layer), 1)))
            position.update({key: i / max(len(layer), 1) for i, key in enumerate(layer)})
    return layers


def _size(box: _Box) -> tuple[float, float]:
    return max(len(line) for line in box.lines) * CHAR_W + 2 * PAD, len(box.lines) * LINE_H + 2 * PAD


def _positions(boxes, layers) -> tuple[dict, float, float]:
    """Top-left corner and size of every box; each layer is centred on the widest one."""
    by_key = {b.key: b for b in boxes}
    sizes = {b.key: _size(b) for b in boxes}
    widths = [sum(sizes[k][0] for k in layer) + GAP_X * (len(layer) - 1) for layer in layers]
    total_w = max(widths, default=0) + 2 * GAP_X
    placed, y = {}, GAP_X
    for layer, width in zip(layers, widths):
        x = (total_w - width) / 2
        for key in layer:
            w, h = sizes[key]
            placed[key] = (x, y, w, h, by_key[key])
            x += w + GAP_X
        y += max(sizes[k][1] for k in layer) + GAP_Y
    return placed, total_w, y


def _svg_box(x, y, w, h, box: _Box) -> str:
    fill, outline, _ = ROLES[box.role]
    dash = ' stroke-dasharray="4 2"' if box.role == "unused" else ""
    text = "".join(f'<tspan x="{x + w / 2:.1f}" dy="{LINE_H if i else 0}">{html.escape(line)}</tspan>'
                   for i, line in enumerate(box.lines))
    return (f'<g><title>{html.escape(box.tooltip or box.key)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" fill="{fill}" '
            f'stroke="{outline}"{dash}/><text y="{y + PAD + LINE_H - 3:.1f}" text-anchor="middle">{text}</text></g>')


def _svg_edge(a, b, marker: str) -> str:
    x1, y1 = a[0] + a[2] / 2, a[1] + a[3]
    x2, y2 = b[0] + b[2] / 2, b[1]
    mid = (y1 + y2) / 2
    return (f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{mid:.1f} {x2:.1f},{mid:.1f} {x2:.1f},{y2 - 2:.1f}" '
            f'marker-end="url(#{marker})"/>')


def _svg_in_python(boxes, edges, ident: str) -> str:
    placed, width, height = _positions(boxes, _layers(boxes, edges))
    marker = f"arrow-{ident}"  # ids are shared by the whole HTML document
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" font-size="10">',
             f'<defs><marker id="{marker}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" markerHeight="6" '
             'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#888"/></marker></defs>',
             '<g fill="none" stroke="#888" stroke-width="0.8">']
    parts += [_svg_edge(placed[a], placed[b], marker) for a, b in edges]
    parts.append("</g>")
    parts += [_svg_box(*placed[b.key]) for b in boxes]
    parts.append("</svg>")
    return "\n".join(parts)


def draw_svg(gm: fx.GraphModule, roles: dict[str, str], layout: str = "auto", ident: str = "g") -> str:
    """An SVG drawing of ``gm``. ``layout``: ``"dot"``, ``"python"``, or ``"auto"`` (dot when installed)."""
    if layout not in ("auto", "dot", "python"):
        raise ValueError(f"layout must be 'auto', 'dot' or 'python'; got {layout!r}")
    boxes, edges = graph_boxes(gm, roles)
    dot = shutil.which("dot")
    if layout == "dot" and dot is None:
        raise RuntimeError("layout='dot' needs graphviz's dot on the PATH (Debian: apt-get install graphviz)")
    if layout != "python" and dot is not None:
        return _svg_with_dot(dot, boxes, edges)
    return _svg_in_python(boxes, edges, ident)


# --- The HTML page -----------------------------------------------------------------------------------------
