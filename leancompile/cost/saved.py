"""What the backbone's AOTAutograd min-cut partition saves, and counting what autograd saves.

The planner prices Retain's activations by the partition of a whole call traced on fake tensors
(:func:`partition_saved_bytes`); the per-row backbone the runtime executes
(:mod:`leancompile.runtime.rowwise`) is the same partition at one row.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._functorch import config as functorch_config

from ..passes.eager_bits import keeping_whole
from ..backbones import Conditioning
from ..backbones.checkpointing import without_checkpointing
from ..passes.graph import reading_data


@dataclass
class SavedBytes:
    """Bytes of the tensors autograd saved for backward while the counter was active, not counting tensors that
    share storage with ``resident`` ones (the weights, which stay in memory anyway). Hooks already active (e.g.
    ``save_on_cpu``, a memory tracker) still see every tensor: the counter hands them on."""

    resident: frozenset = frozenset()  # storage keys of the weights and buffers
    total: int = 0
    storage_key: object = staticmethod(lambda t: t.untyped_storage().data_ptr())  # fake tensors: a weak ref

    @contextlib.contextmanager
    def counting(self):
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)

        def pack(t):
            if self.storage_key(t) not in self.resident:
                self.total += t.numel() * t.element_size()
            return outer_pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack):
            yield


def partition_saved_bytes(backbone, x, sigma, cond: Conditioning, memory_budget: float = 1.0) -> int:
    """Bytes of the activations the backbone's min-cut partition saves for ``(x, sigma, cond)``, weights excluded.

    Traces and partitions without running the forward (the inputs may be fake tensors)."""
    params, buffers, graphs = dict(backbone.named_parameters()), dict(backbone.named_buffers()), {}

    def forward(params, buffers, x, sigma, text, pooled):
        with keeping_whole(x):  # as the per-row program partitions it (passes.eager_bits)
            return torch.func.functional_call(backbone, (params, buffers), (x, sigma, Conditioning(text, pooled)))

    def keep_forward(gm, _):
        graphs["forward"] = gm
        raise _Partitioned

    compiled = _partitioning(forward, keep_forward)
    with without_checkpointing(backbone), functorch_config.patch(activation_memory_budget=memory_budget), \
            contextlib.suppress(_Partitioned):
        compiled(params, buffers, x, sigma, cond.text, cond.pooled)
    return _activation_bytes(graphs["forward"].graph, len(params) + len(buffers), outputs=1)


def block_saved_bytes(block, args: tuple, kwargs: dict, memory_budget: float = 1.0, shared: tuple[str, ...] = ()) -> int:
    """Bytes of the activations a transformer block's own min-cut partition saves for one call at activation
    memory budget ``memory_budget``, weights excluded, its floating inputs requiring grad except those every row
    shares (the keyword arguments ``shared``, a family's ``block_shared``: a rotary embedding, whose gradient the
    runtime does not compute): what Retain per block (runtime.regional) keeps of it."""
    params, buffers, graphs, outputs = dict(block.named_parameters()), dict(block.named_buffers()), {}, []
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def forward(params, buffers, *values):
        flat = list(leaves)
        for i, value in zip(tensors, values):
            flat[i] = value
        call_args, call_kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
        with keeping_whole(values[0] if values else None):  # as the per-row program partitions it
            out = torch.func.functional_call(block, (params, buffers), call_args, call_kwargs)
        out = tuple(t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        outputs.append(len(out))
        return out

    def keep_forward(gm, _):
        graphs["forward"] = gm
        raise _Partitioned

    fixed = {id(t) for name in shared for t in torch.utils._pytree.tree_leaves(kwargs.get(name))}
    values = [leaves[i].detach().requires_grad_(leaves[i].is_floating_point() and id(leaves[i]) not in fixed)
              for i in tensors]
    compiled = _partitioning(forward, keep_forward)
    with functorch_config.patch(activation_memory_budget=memory_budget), contextlib.suppress(_Partitioned):
        compiled(params, buffers, *values)
    return _activation_bytes(graphs["forward"].graph, len(params) + len(buffers), outputs[0])


def _partitioning(forward, fw_compiler):
    """``forward`` under AOTAutograd with the min-cut partitioner. Imported here: AOTAutograd imports torch._dynamo
    (most of a second), which ``import leancompile`` does not need."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return aot_function(forward, fw_compiler=fw_compiler, partition_fn=min_cut_rematerialization_partition)


def _activation_bytes(graph: torch.fx.Graph, weights: int, outputs: int) -> int:
    """The saved tensors of a partition's forward graph (its results after the ``outputs`` the function returns)
    that are activations: they read a data input. What is computed from the weights alone (a weight's transpose,
    a cast, an adapter's scaling) the runtime recomputes for the backward instead of keeping it per row."""
    reads = reading_data(graph, weights)
    results = graph.find_nodes(op="output")[0].args[0][outputs:]
    saved = [n.meta.get("val") for n in results if isinstance(n, torch.fx.Node) and n in reads]
    return sum(v.numel() * v.element_size() for v in saved if isinstance(v, torch.Tensor))


class _Partitioned(Exception):
    """Stops an AOTAutograd compilation once the forward graph is partitioned (nothing is run)."""
