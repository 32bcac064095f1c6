"""Casts: does a graph read an input only through a cast to one dtype?

A bf16 loop may pass an argument in one dtype in its rollout and in another in its update, with equal values
(FlowGRPO's FLUX scripts: a bf16 ``timestep`` then a float32 one; DanceGRPO's Wan script: bf16 latents then float32
ones). Where the module reads that argument only through a cast to one dtype ``D`` (Flux's
``timestep.to(hidden_states.dtype)``, autocast's cast of a convolution's input) or for its shape, its output depends
on the argument only through the argument cast to ``D``: two calls whose arguments are equal once cast to ``D``
compute the same, provided the rest of the module computes the same in both (:func:`same_after_casts`).

:func:`cast_reads` walks the uses of one placeholder of a partition's forward graph (and, where the partition saves
the input itself for the backward, the backward's uses of it) and accepts only ``_to_copy`` that changes the dtype
alone, ``convert_element_type``, and shape queries. It writes ``node.meta[CASTS]`` on the placeholder (read back on
the next call: the graph is compiled once per signature).

Before: ``mul = aten.mul(aten._to_copy(timestep, dtype=bfloat16), 1000)``
After:  ``CastReads(dtype=torch.bfloat16, other="")``
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph import ancestors, op_name
from .meta import CASTS

_CASTS = {"_to_copy.default", "convert_element_type.default"}
_SHAPE_QUERIES = {"sym_size.int", "sym_numel.default", "sym_stride.int", "sym_storage_offset.default"}


@dataclass(frozen=True)
class CastReads:
    """How a graph reads one input: only through casts to ``dtype`` and shape queries (``other`` empty; ``dtype``
    None where no cast reads it), or otherwise too (``other``: the first such read, named)."""

    dtype: torch.dtype | None
    other: str = ""

    @property
    def cast_only(self) -> bool:
        return not self.other


def cast_reads(forward: fx.GraphModule, input: fx.Node, backward: fx.GraphModule | None = None) -> CastReads:
    """How ``forward`` (a partition's forward graph, its outputs the module's output then the saved tensors) reads
    its placeholder ``input``; ``backward``: the partition's backward graph (its placeholders the saved tensors,
    then the cotangent), where the input may be saved for it. Recorded in ``input.meta[CASTS]``."""
    if CASTS not in input.meta:
        reads = _reads(input)
        for user in input.users:
            if user.op != "output":
                continue
            saved = [i for i, value in enumerate(user.args[0]) if value is input]
            if 0 in saved or backward is None:
                reads = CastReads(None, "it is returned as the module's output" if 0 in saved
                                  else "it is returned by the graph")
            else:  # saved for the backward: the backward reads it too
                placeholders = list(backward.graph.find_nodes(op="placeholder"))
                for i in saved:
                    reads = _merged(reads, _reads(placeholders[i - 1]))
        input.meta[CASTS] = reads
    return input.meta[CASTS]


def _reads(input: fx.Node) -> CastReads:
    """How the nodes of one graph read ``input`` (its output node aside: the caller follows that)."""
    dtypes, other = set(), ""
    for user in input.users:
        name = op_name(user) if user.op == "call_function" else user.op
        if user.op == "output" or name in _SHAPE_QUERIES:
            continue
        dtype = _cast_to(user)
        if dtype is None:
            other = other or f"{name} reads it"
        else:
            dtypes.add(dtype)
    return _merged(CastReads(None, other), *(CastReads(d) for d in dtypes))


def _merged(*reads: CastReads) -> CastReads:
    """Several reads as one: casts to two dtypes are not casts to one."""
    dtypes = {r.dtype for r in reads if r.dtype is not None}
    other = next((r.other for r in reads if r.other), "")
    if len(dtypes) > 1:
        other = other or f"it is cast to {' and to '.join(sorted(map(str, dtypes)))}"
    return CastReads(next(iter(dtypes)) if len(dtypes) == 1 else None, other)


def _cast_to(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts its first argument to, where it changes nothing else (None: not such a cast)."""
    if node.op != "call_function" or op_name(node) not in _CASTS:
        return None
    if op_name(node) == "convert_element_type.default":
        return node.args[1]
    if len(node.args) > 1 or set(node.kwargs) - {"dtype", "layout", "device"}:
        return None
    value = node.args[0].meta.get("val")
    if node.kwargs.get("layout", torch.strided) != torch.strided or (
            "device" in node.kwargs and (value is None or node.kwargs["device"] != value.device)):
        return None
    return node.kwargs.get("dtype")


def same_after_casts(cast: fx.GraphModule, plain: fx.GraphModule, inputs: list[int]) -> bool:
    """Whether ``cast``'s output (its first) is computed as ``plain``'s once the casts of ``cast``'s placeholders
    at ``inputs`` are read as the placeholders themselves: the one graph traced on the arguments in the dtype the
    module casts them to, the other on them in another. Compared node for node in graph order (names aside), so
    that a module that branches on an argument's dtype, or casts other values to it, is told apart."""
    theirs, mine = list(plain.graph.find_nodes(op="placeholder")), list(cast.graph.find_nodes(op="placeholder"))
    if len(theirs) != len(mine):
        return False
    env = dict(zip(mine, theirs))
    for i in inputs:
        for user in mine[i].users:
            if _cast_to(user) is not None:
                env[user] = theirs[i]
    mine_nodes = [n for n in _computing_output(cast) if n not in env]
    theirs_nodes = [n for n in _computing_output(plain) if n.op != "placeholder"]
    if len(mine_nodes) != len(theirs_nodes):
        return False
    for a, b in zip(mine_nodes, theirs_nodes):
        if (a.op, a.target) != (b.op, b.target) or fx.node.map_arg((a.args, a.kwargs), env.__getitem__) != (
                b.args, b.kwargs):
            return False
        env[a] = b
    return True


def _computing_output(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the graph's first output is computed from, in graph order."""
    output = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    needed = ancestors(output[0] if isinstance(output, (tuple, list)) else output)
    return [n for n in gm.graph.nodes if n in needed]
