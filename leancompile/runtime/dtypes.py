"""A call whose arguments differ from a kept call's in dtype alone: the same call where the module reads each of them
only through a cast to the kept call's dtype (proven on the call's traced graph, :mod:`leancompile.passes.casts`).

bf16 loops pass some arguments in one dtype in the rollout and in another in the update, with equal values
(FlowGRPO's FLUX scripts: a bf16 ``timestep`` and ``guidance``, then float32 ones; DanceGRPO's Wan script: step 0's
latents in bf16, then in float32). Such a call's rows have no kept row (their bytes differ), so the call is looked
up again with those arguments cast to the kept dtype, the cast the module makes itself: where the module's graph
with the cast read as its input is the kept signature's graph, the call computes what the module computes on the
cast arguments, which is what a kept call with those values computed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from ..passes.casts import cast_reads, same_after_casts
from .calls import Call, argument_paths
from .store import Found, KeptCalls

# ``traced(call)``: the module's graphs on one row of ``call`` (forward, and the backward where the forward saves
# tensors for it), its data placeholders last in the forward's order of the call's tensors
Traced = Callable[[Call], "tuple[fx.GraphModule, fx.GraphModule | None]"]


def through_casts(call: Call, store: KeptCalls, traced: Traced, lookup: Callable[[Call], Found],
                  shared: frozenset[str]) -> tuple[Found, Call | None] | None:
    """``call`` looked up (``lookup``) with its arguments cast to the dtypes of the latest kept call that differs
    from it in those arguments' dtypes alone, where the module reads each only through a cast to that dtype and
    otherwise computes the same, and the call so cast; else why not (and None). None: no kept call differs from it
    so (nor is it a block's call, identified by its backbone call's rows)."""
    dtypes = store.dtype_variant(call.signature()) if call.verified_rows is None else None
    if dtypes is None:
        return None
    paths = argument_paths(call.spec)
    differing = ", ".join(f"argument {paths[i]} has dtype {call.leaves[i].dtype}, the kept call's {dtype}"
                          for i, dtype in dtypes.items())
    cast = _cast(call, dtypes, traced, shared, paths)
    if isinstance(cast, str):
        return Found(None, f"{differing}{cast}", "inputs"), None
    found = lookup(cast)
    if found.match is None:
        return Found(None, f"{differing}; the module reads them only through casts to those dtypes, and the values "
                           f"cast so match no kept call's: {found.reason}", found.kind), None
    return found, cast


def _cast(call: Call, dtypes: dict[int, torch.dtype], traced: Traced, shared: frozenset[str],
          paths: list[str]) -> Call | str:
    """``call`` with the arguments at leaf positions ``dtypes`` cast to those dtypes, where the module reads them
    only so and otherwise computes the same; else why not (to follow the arguments' dtypes in a reason)."""
    try:
        forward, backward = traced(call)
    except Exception as error:  # what does not trace cannot be shown to read its arguments through casts
        return f", and the module does not trace ({type(error).__name__}: {error})"
    placeholders = list(forward.graph.find_nodes(op="placeholder"))
    inputs = {leaf: len(placeholders) - len(call.tensors) + position
              for position, (leaf, _) in enumerate(_tensor_leaves(call))}  # each argument's placeholder
    for leaf, dtype in dtypes.items():
        if call.leaves[leaf].requires_grad:
            return f", and {paths[leaf]} requires grad: a served call returns no gradient through a cast"
        reads = cast_reads(forward, placeholders[inputs[leaf]], backward)
        if not reads.cast_only or reads.dtype not in (None, dtype):
            why = reads.other or f"it is cast to {reads.dtype}"
            return f", and the module reads {paths[leaf]} other than through a cast to {dtype}: {why}"
    cast = Call.of(*call.with_tensors(t.detach().to(dtypes[leaf]) if leaf in dtypes else t
                                      for leaf, t in _tensor_leaves(call)), shared)
    try:
        same = same_after_casts(forward, traced(cast)[0], [inputs[leaf] for leaf in dtypes])
    except Exception as error:
        return f", and the module does not trace with them cast ({type(error).__name__}: {error})"
    if not same:
        return ("; the module reads them only through casts to the kept dtypes, but computes otherwise with them "
                "cast (it reads their dtype elsewhere)")
    return cast


def _tensor_leaves(call: Call):
    """``(leaf position, tensor)`` for each of the call's tensor leaves, in order."""
    return [(i, leaf) for i, leaf in enumerate(call.leaves) if isinstance(leaf, torch.Tensor)]
