"""In-place scatters: give the partitioned forward back the in-place writes functionalization took out.

Eager code that fills a fresh buffer piece by piece (Wan's rotary embedding writes the even and the odd halves of
``torch.empty_like(q)``) is traced by AOTAutograd as ``slice_scatter`` ops, each of which copies the whole
buffer. Where the buffer is a fresh allocation (or a scatter already made in place) read by nothing but the
scatter, writing the slice in place computes the same values without the copies::

    buf = empty_like(q); a = slice_scatter(buf, copy(slice(buf, -1, 0, None, 2), x), -1, 0, None, 2); ...
    ->  buf = empty_like(q); copy_(slice(buf, -1, 0, None, 2), x); ...   (later uses of a read buf)
"""
from __future__ import annotations

import torch

from .meta import REWRITE, Rewrite

aten = torch.ops.aten
_FRESH = {aten.empty_like.default, aten.empty.memory_format, aten.zeros_like.default, aten.zeros.default,
          aten.full.default, aten.new_zeros.default, aten.new_empty.default}


def write_scatters_in_place(gm: torch.fx.GraphModule) -> int:
    """Rewrite the eligible ``slice_scatter`` nodes of ``gm`` as in-place copies; returns how many."""
    owned = {n for n in gm.graph.nodes if n.target in _FRESH}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.slice_scatter.default:
            continue
        base, src, *where = node.args
        # Functionalization writes ``buf[s] = x`` as ``slice_scatter(buf, copy(slice(buf, s), x), s)``.
        view = src.args[0] if src.target is aten.copy.default else None
        written = (view is not None and view.target is aten.slice.Tensor and view.args == (base, *where)
                   and len(view.users) == 1 and len(src.users) == 1)
        # Readers of the buffer besides the scatter; a dead view reads nothing.
        readers = [u for u in base.users if u.meta.get(REWRITE) is not Rewrite.IN_PLACE and not (written and u is view)
                   and (u.users or u is node)]
        if base not in owned or readers != [node]:
            continue
        with gm.graph.inserting_before(node):
            target = gm.graph.call_function(aten.slice.Tensor, (base, *where), dict(node.kwargs))
            copy = gm.graph.call_function(aten.copy_.default, (target, src.args[1] if written else src))
        target.meta[REWRITE] = copy.meta[REWRITE] = Rewrite.IN_PLACE
        node.replace_all_uses_with(base)
        gm.graph.erase_node(node)
        if written:
            gm.graph.erase_node(src)
            gm.graph.erase_node(view)
        owned.add(base)  # still fresh: only the copies wrote into it
        rewritten += 1
    return rewritten
