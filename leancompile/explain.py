"""Readable reports of an optimized trainer: its plan and its rewritten graphs."""
from __future__ import annotations

from .passes.meta import CALL, REWRITE, SHARED, Rewrite


def graph_summary(gm) -> dict:
    nodes = list(gm.graph.nodes)
    return {
        "nodes": len(nodes),
        "backbone": sum(CALL in n.meta for n in nodes),
        "shared": sum(SHARED in n.meta for n in nodes),
        "inserted": [n.name for n in nodes if n.meta.get(REWRITE) is Rewrite.INSERTED],
        "reused": [n.name for n in nodes if n.meta.get(REWRITE) is Rewrite.REUSED],
    }


def explain_text(trainer) -> str:
    lines = [str(trainer.plan), "", "graphs:"]
    for name, gm in trainer.graphs.items():
        s = graph_summary(gm)
        extra = "".join(f", {k}: {_names(s[k])}" for k in ("inserted", "reused") if s[k])
        lines.append(f"  {name:<18} {s['nodes']:>5} nodes, {s['backbone']:>5} in backbone calls{extra}")
    history = getattr(trainer, "pass_history", None)
    if history is not None and history.records:
        lines += ["", "passes (in the order they ran):", history.table()]
    return "\n".join(lines)


def _names(names: list[str], shown: int = 6) -> str:
    if len(names) <= shown:
        return ", ".join(names)
    return f"{len(names)} nodes ({', '.join(names[:shown // 2])}, ..., {', '.join(names[-(shown // 2):])})"
