"""The backbone compiled by AOTAutograd and split by the min-cut partitioner.

Called with grad, the compiled backbone runs the partition's forward graph and saves exactly the tensors its
backward graph needs: the activations a Retain plan keeps from the rollout until the update's backward. Both graphs
run eagerly after multiplications by one and copies nothing else reads are dropped and each matrix product is put
in the operand order the device runs faster (unless ``tune_matmuls=False``); the forward's scatters into fresh
buffers are also written in place. One compilation per input signature (shapes, dtypes, autocast, adapter state);
the forward and backward graphs of the last compilation are kept for inspection.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from functorch.compile import make_boxed_func
from torch._functorch import config as functorch_config
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

from ..backbones import Conditioning
from ..passes.identities import drop_copies_of_unshared_values, drop_multiplications_by_one
from ..passes.inplace import write_scatters_in_place
from ..passes.matmul_order import order_matrix_products


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


@contextlib.contextmanager
def without_checkpointing(model):
    """Retention is the opposite of activation checkpointing: compile the plain blocks."""
    old = getattr(model, "gradient_checkpointing", False)
    model.gradient_checkpointing = False
    try:
        yield
    finally:
        model.gradient_checkpointing = old


class PartitionedBackbone:
    """``backbone(x, sigma, cond)`` through AOTAutograd's joint graph and min-cut partition."""

    def __init__(self, backbone, memory_budget: float = 1.0, tune_matmuls: bool = True):
        self.backbone = backbone
        self.memory_budget = memory_budget
        self.tune_matmuls = tune_matmuls  # False: products run as traced, whatever the device times
        self._compiled = {}
        # Looked up once: walking the modules on every call costs milliseconds per step.
        self._params = dict(backbone.named_parameters())
        self._buffers = dict(backbone.named_buffers())
        self._lora_layers = [m for m in backbone.modules() if hasattr(m, "lora_A")]
        self.forward_graph: torch.fx.GraphModule | None = None
        self.backward_graph: torch.fx.GraphModule | None = None

    @functools.cached_property
    def resident(self) -> frozenset:
        """Storage pointers of the weights and buffers (read when counting saved bytes of real tensors)."""
        return frozenset(t.untyped_storage().data_ptr() for t in (*self._params.values(), *self._buffers.values()))

    def _signature(self, x, sigma, cond):
        pooled = None if cond.pooled is None else (tuple(cond.pooled.shape), cond.pooled.dtype)
        autocast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        return (tuple(x.shape), x.dtype, tuple(sigma.shape), tuple(cond.text.shape), cond.text.dtype, pooled,
                autocast, tuple(m.disable_adapters for m in self._lora_layers))

    def _compile(self, rows: int, run: bool = True):
        backbone = self.backbone

        def forward(params, buffers, x, sigma, text, pooled):
            cond = Conditioning(text, pooled)
            return torch.func.functional_call(backbone, (params, buffers), (x, sigma, cond))

        def keep_forward(gm, _):
            self.forward_graph = gm
            if not run:
                raise _Partitioned
            write_scatters_in_place(gm)
            self._simplify(gm)
            return make_boxed_func(gm)

        def keep_backward(gm, _):
            self._simplify(gm)
            self.backward_graph = gm
            return make_boxed_func(gm)

        return aot_function(forward, fw_compiler=keep_forward, bw_compiler=keep_backward,
                            partition_fn=min_cut_rematerialization_partition)

    def _simplify(self, gm: torch.fx.GraphModule) -> None:
        """The passes both partition graphs run through before they are executed."""
        drop_multiplications_by_one(gm)
        drop_copies_of_unshared_values(gm)
        if self.tune_matmuls:
            order_matrix_products(gm)

    def __call__(self, x, sigma, cond: Conditioning) -> torch.Tensor:
        key = self._signature(x, sigma, cond)
        compiling = key not in self._compiled
        if compiling:
            self._compiled[key] = self._compile(x.shape[0])
        # aot_function traces and partitions on its first call: the budget only matters then.
        budget = (functorch_config.patch(activation_memory_budget=self.memory_budget) if compiling
                  else contextlib.nullcontext())
        with without_checkpointing(self.backbone.model), budget:
            return self._compiled[key](self._params, self._buffers, x, sigma, cond.text, cond.pooled)

    def saved_bytes(self, x, sigma, cond: Conditioning) -> int:
        """Bytes of the activations the partition's forward would save for ``(x, sigma, cond)``, weights excluded.

        Traces and partitions without running the forward (the inputs may be fake tensors)."""
        with without_checkpointing(self.backbone.model), \
                functorch_config.patch(activation_memory_budget=self.memory_budget), \
                contextlib.suppress(_Partitioned):
            self._compile(x.shape[0], run=False)(self._params, self._buffers, x, sigma, cond.text, cond.pooled)
        graph = self.forward_graph.graph
        weights = list(graph.find_nodes(op="placeholder"))[:len(self._params) + len(self._buffers)]
        # A saved transpose of a weight is a view of it, not an activation.
        resident = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in weights}
        saved = [n.meta.get("val") for n in graph.find_nodes(op="output")[0].args[0][1:] if isinstance(n, torch.fx.Node)]
        return sum(v.numel() * v.element_size() for v in saved
                   if isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) not in resident)


class _Partitioned(Exception):
    """Stops an AOTAutograd compilation once the forward graph is partitioned (nothing is run)."""

