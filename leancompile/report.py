"""An HTML inspection report of an optimized trainer: its plan, its pass history, its explanation and a drawing of
every graph (:mod:`leancompile.drawing`), with the nodes the rewrite inserted, reused or removed highlighted.

The traced graphs hold ~700-1500 aten nodes, most of them inside backbone calls. A drawing of every node is
unreadable, so each backbone call region is drawn as one box that summarises it (node count, most frequent ops,
parameters) and only the nodes around it (the sampler and loss heads) are drawn one by one.
"""
from __future__ import annotations

import html
from pathlib import Path

from .drawing import ROLES, draw_svg
from .passes.meta import CALL, REWRITE, SHARED, Rewrite

HIGHLIGHTED = ("inserted", "reused", "removed")


# --- What each node is -----------------------------------------------------------------------------------


def _removed_names(graphs: dict, name: str) -> set[str]:
    """Shared nodes of a traced original that its rewritten program no longer has."""
    if not name.endswith("_traced") or name[: -len("_traced")] not in graphs:
        return set()
    kept = {n.name for n in graphs[name[: -len("_traced")]].graph.nodes}
    return {n.name for n in graphs[name].graph.nodes if SHARED in n.meta and n.name not in kept}


def node_roles(graphs: dict, name: str) -> dict[str, str]:
    """The highlighted role of each node of ``graphs[name]`` that has one: inserted, reused, removed or backbone.

    A node has one role; the rewrite's marks win over the backbone tag, so a removed call node counts as removed.
    """
    removed = _removed_names(graphs, name)
    roles = {}
    for node in graphs[name].graph.nodes:
        if node.meta.get(REWRITE) in (Rewrite.INSERTED, Rewrite.REUSED):
            roles[node.name] = str(node.meta[REWRITE])
        elif node.name in removed:
            roles[node.name] = "removed"
        elif CALL in node.meta:
            roles[node.name] = "backbone"
    return roles


def summary(trainer) -> dict[str, dict]:
    """Per graph: node count, and the count and names of its inserted, reused, removed and backbone nodes."""
    result = {}
    for name, gm in trainer.graphs.items():
        roles = node_roles(trainer.graphs, name)
        names = {role: [n for n, r in roles.items() if r == role] for role in (*HIGHLIGHTED, "backbone")}
        entry = {"nodes": len(gm.graph.nodes), **{role: len(found) for role, found in names.items()}}
        entry["names"] = {role: names[role] for role in HIGHLIGHTED}
        result[name] = entry
    return result


_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; font-size: 13px; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 12px; }
.drawing { overflow: auto; max-height: 90vh; border: 1px solid #ddd; margin-bottom: 2em; }
.swatch { display: inline-block; width: 1.2em; height: 0.9em; border: 1px solid; vertical-align: middle; }
"""


def _rows(cells_per_row, header=None) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>"
                   for cells in cells_per_row)
    return f"<table>{head}{body}</table>"


def _plan_html(plan) -> str:
    steps = [(a.step, a.label, a.reason) for a in plan.steps]
    return _rows(plan.facts()) + _rows(steps, header=("step", "action", "reason"))


def _history_html(history) -> str:
    if history is None or not history.records:
        return "<p>no pass has run yet</p>"
    rows = [(r.name, r.graph, r.changed, f"{r.nodes[0]} -> {r.nodes[1]}", f"{r.seconds * 1e3:.1f}", r.found)
            for r in history.records]
    return _rows(rows, header=("pass", "graph", "nodes changed", "nodes", "ms", "found"))


def _summary_html(counts: dict) -> str:
    rows = [(name, c["nodes"], c["backbone"], c["inserted"], c["reused"], c["removed"]) for name, c in counts.items()]
    return _rows(rows, header=("graph", "nodes", "backbone-call nodes", "inserted", "reused", "removed"))


def _legend_html() -> str:
    items = "".join(f'<li><span class="swatch" style="background:{fill};border-color:{outline}"></span> '
                    f"{html.escape(text)}</li>" for fill, outline, text in ROLES.values())
    return f'<div class="legend"><h3>Legend</h3><ul>{items}</ul></div>'


def _graph_html(name: str, gm, roles: dict[str, str], layout: str, index: int) -> str:
    svg = draw_svg(gm, roles, layout=layout, ident=f"g{index}")
    return f'<h3 id="graph-{html.escape(name)}">{html.escape(name)}</h3><div class="drawing">{svg}</div>'


def write_html_report(trainer, path, layout: str = "auto") -> Path:
    """Write one self-contained HTML file describing an optimized ``trainer``; return its path."""
    path = Path(path)
    counts = summary(trainer)
    graphs = "".join(_graph_html(name, gm, node_roles(trainer.graphs, name), layout, i)
                     for i, (name, gm) in enumerate(trainer.graphs.items()))
    page = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>leancompile report</title>'
            f"<style>{_CSS}</style></head><body><h1>leancompile report</h1>"
            f"<h2>Plan</h2>{_plan_html(trainer.plan)}"
            f"<h2>Passes</h2>{_history_html(getattr(trainer, 'pass_history', None))}"
            f"<h2>Explanation</h2><pre>{html.escape(trainer.explain())}</pre>"
            f"<h2>Graphs</h2>{_summary_html(counts)}{_legend_html()}{graphs}</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
