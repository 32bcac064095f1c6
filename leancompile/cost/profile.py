"""Profiles of backbone calls on fake tensors: what a call saves for its backward and what it costs to run.

Nothing is allocated or computed: the backbone's weights are replaced by fake tensors (of any size, so FLUX.1-dev
at 1024 px profiles on a laptop) and every operator only propagates shapes. Saved bytes come from the same
AOTAutograd min-cut partition the Retain runtime runs; on a deep model the partition is traced on a copy holding
one block of each kind, and once more with one extra block per kind, and the per-block increments are multiplied
out (the blocks of a kind are identical, so this is exact up to the partitioner's choices at block boundaries).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..backbones import Conditioning
from ..backbones.plain import fake_like
from torch.multiprocessing.reductions import StorageWeakRef

from .saved import SavedBytes, block_saved_bytes, partition_saved_bytes
from .workload import Workload, WorkloadCounter


PARTIAL_BUDGETS = (0.0, 0.1, 0.25, 0.5, 1.0)  # the activation memory budgets a partial retention may use


@dataclass(frozen=True)
class CallProfile:
    """One backbone call over one row (activations and FLOPs scale with the rows; launches do not)."""

    tokens: int  # sequence length the blocks see (image/video tokens plus text tokens where they are joint)
    retained_bytes: int  # activations the partition saves for the backward (the weights excluded)
    eager_bytes: int  # activations eager autograd saves (the native update's call)
    checkpoint_bytes: int  # what activation checkpointing keeps instead: the blocks' inputs
    block_retained_bytes: int  # what the blocks' own partitions save (Retain per block, runtime.regional)
    blocks: int  # transformer blocks (checkpointing recomputes one at a time)
    forward: Workload  # forward with grad (the rollout's no-grad forward runs the same operators)
    backward: Workload
    # Reweight's per-row gradients of the trainable linear weights it keeps as two factors (those whose factors are
    # smaller, passes.rowwise.keep_products_as_factors): their elements, and the factors' per cotangent (the
    # output's side) and per row (the input's side, shared by the layers reading one input)
    factored_params: int
    factors_per_cotangent: int
    factors_per_row: int
    # Traced when a partial retention is first priced (a partition per budget: the whole call's, each block's)
    measure_budget: Callable[[float], int] = field(compare=False, repr=False)
    measure_block_budget: Callable[[float], int] = field(compare=False, repr=False)

    def retained_at(self, budget: float, per_block: bool = False) -> int:
        """What the partition saves at activation memory budget ``budget`` (one of PARTIAL_BUDGETS): retain@f keeps
        the partition at budget f, and the min-cut answers in steps, not in proportion (tiny Flux at 0.15 keeps
        0.42 of it). ``per_block``: the blocks' own partitions, each at that budget."""
        if budget not in PARTIAL_BUDGETS:
            raise ValueError(f"budget must be one of {PARTIAL_BUDGETS}; got {budget!r}")
        if budget == 1:
            return self.block_retained_bytes if per_block else self.retained_bytes
        return self.measure_block_budget(budget) if per_block else self.measure_budget(budget)


def profile_call(backbone, autocast: torch.dtype | None = None, device_type: str = "cpu") -> CallProfile:
    """Profile ``backbone(x, sigma, cond)`` over one row with its parameters' current ``requires_grad``.

    ``backbone`` may live on the meta device (a real-size model from :func:`leancompile.backbones.real`) or hold
    real weights (a trainer's); it is not modified. ``autocast`` profiles under ``torch.autocast``.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_copy(backbone, mode, device_type)
    args = _fake_inputs(fake, 1, mode)
    cast = torch.autocast(device_type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    stacks = [(name, blocks, _kinds(blocks)) for name, blocks in fake.block_stacks()]
    firsts = {name: [ids[0] for ids in kinds.values()] for name, _, kinds in stacks}
    # A second block of each repeated kind, not the first one twice: the partition would share its weights' views.
    extra = [(name, ids[1], len(ids) - 1) for name, _, kinds in stacks for ids in kinds.values() if len(ids) > 1]
    blocks = sum(len(b) for _, b, _ in stacks)
    with cast:
        if blocks <= sum(map(len, firsts.values())) + len(extra) + 1:
            smallest = fake
            total = base = _measure_call(fake, args, mode)  # shallow: the whole model is as cheap as the pieces
        else:
            smallest = _with_blocks(fake, firsts)
            base = _measure_call(smallest, args, mode)
            total = base
            for name, second, more in extra:
                variant = _measure_call(_with_blocks(fake, {**firsts, name: sorted(firsts[name] + [second])}),
                                        args, mode)
                total = total + (variant - base) * more

    @functools.lru_cache(maxsize=None)
    def measure_budget(budget: float) -> int:
        # The share kept at this budget, from one block of each kind (the blocks repeat it)
        with cast, mode:
            return total.retained * _saved_at(smallest, args, budget, base.retained) // max(base.retained, 1)

    counts = collections.Counter(repr(block) for _, stack, _ in stacks for block in stack)

    @functools.lru_cache(maxsize=None)
    def measure_block_budget(budget: float) -> int:
        # One block of each kind at this budget, times the blocks of its kind
        with cast, _recording_blocks(smallest) as calls, mode:
            smallest(*args)
            kinds = {repr(block): (block, a, kw) for block, a, kw in calls}
            return sum(counts[kind] * block_saved_bytes(*call, budget, fake.spec.block_shared)
                       for kind, call in kinds.items())

    return CallProfile(_tokens(fake), total.retained, total.eager, total.checkpoint, total.per_block, blocks,
                       total.forward, total.backward, total.factored, total.per_cotangent, total.per_row,
                       measure_budget, measure_block_budget)


@dataclass(frozen=True)
class _Measured:
    retained: int
    eager: int
    checkpoint: int
    per_block: int
    forward: Workload
    backward: Workload
    factored: int
    per_cotangent: int
    per_row: int

    def __add__(self, other):
        return _Measured(*(a + b for a, b in zip(self._fields(), other._fields())))

    def __sub__(self, other):
        return _Measured(*(a - b for a, b in zip(self._fields(), other._fields())))

    def __mul__(self, times: int):
        return _Measured(*(a * times for a in self._fields()))

    def _fields(self):
        return (self.retained, self.eager, self.checkpoint, self.per_block, self.forward, self.backward,
                self.factored, self.per_cotangent, self.per_row)


def _measure_call(fake, args, mode) -> _Measured:
    """One call of ``fake``: the partition's saved bytes, the blocks' inputs, the forward's and backward's ops."""
    counter = WorkloadCounter()
    eager = SavedBytes(frozenset(StorageWeakRef(t.untyped_storage()) for t in (*fake.parameters(), *fake.buffers())),
                       storage_key=lambda t: StorageWeakRef(t.untyped_storage()))
    with _recording_blocks(fake) as block_calls, _recording_linears(fake) as linears, mode, counter, \
            eager.counting():
        out = fake(*args)
    forward = counter.workload()
    trainable = [p for p in fake.parameters() if p.requires_grad]
    counter = WorkloadCounter()
    with mode, counter:
        torch.autograd.grad(out, trainable or [args[0]], torch.ones_like(out), allow_unused=True)
    with mode:
        retained = partition_saved_bytes(fake, *args)
        per_block = sum(_block_saved(block, a, kw, seen, fake.spec.block_shared) for seen in [{}]
                        for block, a, kw in block_calls)
    return _Measured(retained, eager.total, sum(_tensor_bytes(call[1:]) for call in block_calls), per_block,
                     forward, counter.workload(), *_factors(linears))


@contextlib.contextmanager
def _recording_linears(fake):
    """Every call of a linear layer with a trainable weight: ``(layer, its input)``."""
    calls = []
    record = lambda layer, inputs, _: calls.append((layer, inputs[0]))
    handles = [m.register_forward_hook(record) for m in fake.modules()
               if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _factors(calls: list) -> tuple[int, int, int]:
    """The weights' elements kept as factors, and the factors' elements per cotangent and per row: a layer called
    once (one row, ``k`` tokens) whose factors are smaller, ``k (out + in) < out in``; the input side counted once
    per input."""
    once = collections.Counter(id(layer) for layer, _ in calls)
    factored = per_cotangent = 0
    inputs = {}
    for layer, x in calls:
        out, inp, k = layer.out_features, layer.in_features, x.numel() // max(x.shape[-1], 1)
        if once[id(layer)] == 1 and k * (out + inp) < out * inp:
            factored, per_cotangent = factored + out * inp, per_cotangent + out * k
            inputs[id(x)] = k * inp
    return factored, per_cotangent, sum(inputs.values())


# ------------------------------------------------------------------------------------------------ fake model

def _fake_copy(backbone, mode: FakeTensorMode, device_type: str):
    """A copy of ``backbone`` whose parameters and buffers are fake tensors on ``device_type``."""
    shared = {id(t): t for t in (*backbone.parameters(), *backbone.buffers())}
    clone = copy.deepcopy(backbone, memo=dict(shared))  # new modules, the same tensors: nothing is copied
    device = torch.device(device_type)
    for module in clone.modules():
        # Only the computation: a wrapper's hooks (a data-parallel gather) would run whenever the copy is traced
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None:
                    continue
                if t.is_meta or isinstance(t, FakeTensor):  # a fake of another mode (trainers.parallel): its shape
                    f = fake_like(t, mode, device)
                else:
                    f = mode.from_tensor(t.detach())
                store[name] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
    return clone


def _fake_inputs(backbone, batch: int, mode: FakeTensorMode):
    """Inputs of one call, with the dtype and on the device of ``backbone``'s (fake) parameters."""
    weight = next(backbone.parameters())
    like = dict(dtype=weight.dtype, device=weight.device)
    with mode:
        x = torch.empty(batch, *backbone.latent_shape, **like)
        sigma = torch.empty(batch, **like)
        text = torch.empty(batch, *backbone.text_shape, **like)
        pooled = None if backbone.pooled_dim is None else torch.empty(batch, backbone.pooled_dim, **like)
    return x, sigma, Conditioning(text, pooled)


def _saved_at(fake, args, budget: float, full: int) -> int:
    """The partition's saved bytes at activation memory budget ``budget``; where the partitioner fails at it
    (Wan's at some budgets), ``full``: the planner then never prefers it, and the runtime would not compile it."""
    try:
        return partition_saved_bytes(fake, *args, memory_budget=budget)
    except RuntimeError:
        return full


@contextlib.contextmanager
def _recording_blocks(fake):
    """Yields the list of ``(block, args, kwargs)`` of the block calls made inside."""
    calls = []
    handles = [b.register_forward_pre_hook(lambda block, a, kw: calls.append((block, a, kw)), with_kwargs=True)
               for _, blocks in fake.block_stacks() for b in blocks]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _block_saved(block, args, kwargs, seen: dict, shared: tuple[str, ...]) -> int:
    """``block_saved_bytes``, partitioned once per block structure and input shapes (blocks of a kind are equal)."""
    shapes = tuple((tuple(t.shape), t.dtype) for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor))
    key = (repr(block), shapes)
    if key not in seen:
        seen[key] = block_saved_bytes(block, args, kwargs, shared=shared)
    return seen[key]


def _tensor_bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_flatten(values)[0]
               if isinstance(t, torch.Tensor))


def _tokens(backbone) -> int:
    """Tokens per row the blocks attend over."""
    return backbone.spec.tokens(backbone.model.config, backbone.latent_shape, backbone.text_shape[0])


# ------------------------------------------------------------------------------------------- saved activations

def _kinds(blocks: torch.nn.ModuleList) -> dict[str, list[int]]:
    """Block indices by kind: blocks with the same structure (modules, shapes) save the same tensors."""
    kinds: dict[str, list[int]] = {}
    for i, block in enumerate(blocks):
        kinds.setdefault(repr(block), []).append(i)
    return kinds


def _with_blocks(fake, keep: dict[str, list[int]]):
    """A shallow variant of ``fake`` whose block stacks hold the blocks ``keep`` lists (indices may repeat)."""
    variant = copy.copy(fake)
    model = copy.copy(fake.model)
    model._modules = dict(model._modules)
    for name, ids in keep.items():
        blocks = fake.model._modules[name]
        model._modules[name] = torch.nn.ModuleList([blocks[i] for i in ids])
    variant._modules = {**fake._modules, "model": model}
    return variant
