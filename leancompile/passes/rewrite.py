"""Rewrite for Retain: the rollout keeps the shared call's output (and its autograd graph) for the update, and
the update reads it instead of recomputing the backbone.

Before (update)::

    %out = <backbone: 676 aten nodes>(%params..., %latents, %rows, %steps)
    %v = ... %out ... ; %loss = ...

After::

    rollout: %retain_backbone_out_for_update = aten.alias(%out)      # new graph output
    update:  %reused_backbone_out_from_rollout = placeholder          # the backbone's nodes are gone
             %v = ... %reused_backbone_out_from_rollout ... ; %loss = ...

Inserted and reused nodes carry ``node.meta[REWRITE]`` and self-explaining names.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from .shared import backbone_calls, call_boundary
from .meta import REWRITE, Rewrite

RETAINED = "retain_backbone_out_for_update"
REUSED = "reused_backbone_out_from_rollout"


@dataclass(frozen=True)
class RewrittenPrograms:
    rollout: fx.GraphModule
    update: fx.GraphModule
    inserted: tuple[str, ...]  # new nodes, in either graph
    removed: tuple[str, ...]  # update nodes the rewrite made dead and erased


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph. Copying a traced graph's pytree specs makes torch warn that ``LeafSpec`` is
    deprecated (its own spec, not the caller's code): not the user's to see."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def rewrite_for_retain(rollout: fx.GraphModule, update: fx.GraphModule, pair: tuple[int, int]) -> RewrittenPrograms:
    update_call, rollout_call = pair
    new_rollout, new_update = _copy(rollout), _copy(update)
    inserted = []

    _, r_outputs = call_boundary(backbone_calls(new_rollout)[rollout_call])
    output = next(n for n in new_rollout.graph.nodes if n.op == "output")
    kept = []
    for i, out in enumerate(r_outputs):
        with new_rollout.graph.inserting_after(out):
            node = new_rollout.graph.call_function(torch.ops.aten.alias.default, (out,))
        node.name = RETAINED if i == 0 else f"{RETAINED}_{i}"
        node.meta.update(val=out.meta.get("val"), **{REWRITE: Rewrite.INSERTED})
        kept.append(node)
        inserted.append(node.name)
    results = output.args[0]
    output.args = ((*results, *kept) if isinstance(results, (tuple, list)) else (results, *kept),)

    before = {n.name for n in new_update.graph.nodes}
    region = backbone_calls(new_update)[update_call]
    _, u_outputs = call_boundary(region)
    first = next(n for n in new_update.graph.nodes if n.op != "placeholder")
    for i, out in enumerate(u_outputs):
        with new_update.graph.inserting_before(first):
            node = new_update.graph.placeholder(REUSED if i == 0 else f"{REUSED}_{i}")
        node.meta.update(val=out.meta.get("val"), **{REWRITE: Rewrite.REUSED})
        out.replace_all_uses_with(node)
        inserted.append(node.name)
    # The region is pure backbone computation; attention ops count as impure for generic DCE (they may draw
    # dropout), so its dead nodes are erased here, last first.
    for node in reversed(region):
        if not node.users:
            new_update.graph.erase_node(node)
    new_update.graph.eliminate_dead_code()
    removed = tuple(sorted(before - {n.name for n in new_update.graph.nodes}))
    for gm in (new_rollout, new_update):
        gm.graph.lint()
        gm.recompile()
    return RewrittenPrograms(new_rollout, new_update, tuple(inserted), removed)
