"""Frameworks that manage a module's parameters themselves, so that its calls cannot be verified, and wrappers whose
own forward must run around every call: found without importing them (a framework not imported has sharded
nothing)."""
from __future__ import annotations

import sys

import torch

from ..backbones.plain import zero3_leaf, zero3_sharded
from ..plan import VALUES


def framework_refusal(module: torch.nn.Module, schedule: str | None = None, per_block: bool | None = None,
                      verify: str = VALUES) -> str | None:
    """Why a framework that manages the module's parameters itself keeps it from being served (None: none does).
    ``schedule``, ``per_block`` and ``verify``: the wrapper's request (FSDP1 and ZeRO-3 are served per block, under
    Retain)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is not None and (any(isinstance(m, fsdp.FullyShardedDataParallel) for m in module.modules()) or any(
            isinstance(p, fsdp.FlatParameter) for p in module.parameters())):
        refusal = fsdp1_refusal(module, schedule, per_block)
        if refusal is not None:
            return f"{refusal}; it runs natively"
    ddp = torch.nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in module.modules() if m is not module):
        return ("a DistributedDataParallel inside the module arms its reducer in its own forward, which the "
                "engine's program would bypass; it runs natively. Wrap the DistributedDataParallel itself, or the "
                "module it holds")
    if zero3_sharded(module):
        refusal = zero3_refusal(module, schedule, per_block, verify)
        if refusal is not None:
            return f"{refusal}; it runs natively"
    return None


def zero3_refusal(module: torch.nn.Module, schedule: str | None = None, per_block: bool | None = None,
                  verify: str = VALUES) -> str | None:
    """Why DeepSpeed ZeRO-3 keeps ``module`` from being served per block (None: it is served). ZeRO-3 gathers each
    submodule's own parameters in that submodule's forward hooks and again before its backward: a block served from
    kept tensors runs none of its submodules, so each block must gather its whole tree in its own hooks, as a ZeRO-3
    leaf module does (``deepspeed.utils.set_z3_leaf_modules`` before ``deepspeed.initialize``, or the
    configuration's ``zero_optimization.leaf_module``). Then each block's ``forward`` is routed to the block's
    engine while DeepSpeed's hooks on the block run around it, as FSDP2's do: the pre-forward gathers the block's
    parameters and registers the post-backward release on its inputs, the post-forward frees them and registers the
    pre-backward gather on its outputs; the served backward's parameter gradients reach DeepSpeed's reduce-scatter
    hooks through autograd, as native's do. The weights' values are read from each parameter's partition
    (``ds_tensor``), which the optimizer writes through ``.data``, moving no version counter: only the digest sees
    the step."""
    from .regional import transformer_blocks

    head = "DeepSpeed ZeRO-3"
    blocks = transformer_blocks(module)
    if schedule == "reweight":
        return (f"{head} with schedule='reweight': Reweight's loss heads would run ZeRO-3's gathers for blocks they "
                "answer from kept outputs, which is not served yet; use schedule='retain'")
    if per_block is False:
        return f"{head} is served per block only; per_block=False keeps the whole call, whose trace ZeRO-3's " \
            "gathers would leave"
    if verify != VALUES:
        return (f"{head} with verify={verify!r}: ZeRO-3's optimizer writes the partitions without moving a version "
                f"counter, which only the digest of their values sees; use verify={VALUES!r}")
    unleaved = [b for b in blocks if not zero3_leaf(b)]
    if unleaved or not blocks:
        name = type(unleaved[0]).__name__ if unleaved else "no block"
        return (f"{head} gathers each submodule's own parameters in that submodule's forward hooks, which a block "
                f"served from kept tensors would skip; it is served per block where each transformer block is a "
                f"ZeRO-3 leaf module, and {name} is not: call deepspeed.utils.set_z3_leaf_modules(model, "
                f"[{name}, ...]) before deepspeed.initialize, or name the classes in the configuration's "
                '"zero_optimization": {"leaf_module": {"classes": [...]}}')
    return None


def fsdp1_refusal(module: torch.nn.Module, schedule: str | None = None,
                  per_block: bool | None = None) -> str | None:
    """Why FSDP1 (``FullyShardedDataParallel``) units in ``module`` keep it from being served per block (None: it is
    served). Served: ``module`` is the FSDP1 root itself (wrapped after FSDP1) or the module the root holds (wrapped
    before FSDP1: the root's forward gathers the parameters outside the blocks around the wrapped module's call),
    every transformer block is its own unit (an auto-wrap policy per block), with its checkpoint wrapper inside the
    unit (activation checkpointing applied after FSDP1) or around it (applied before), and every unit shards
    FULL_SHARD or SHARD_GRAD_OP, with or without ``mixed_precision``, without CPU offload. Each block's ``forward``
    inside its unit is routed to the block's engine while the unit's own forward runs around it (FSDP1 gathers the
    flat parameter before and frees it after, and registers its pre-backward gather on the output); the block's
    parameters in that forward are FSDP1's views into the gathered flat parameter, which the program reads and whose
    gradients reach the flat parameter's post-backward reduce-scatter through autograd, as native's do. With
    ``use_orig_params=True`` FSDP1 registers those views as the block's parameters, and the state is read from the
    original parameters (the optimizer's); with ``use_orig_params=False`` it sets them as plain tensor attributes,
    which the program reads by name, and the state is the flat parameters' (their versions, and their local shards'
    values). With ``mixed_precision`` the gathered flat parameter is in ``param_dtype``, and so are the program's
    weights; the state is read from the sharded full-precision values, which determine the gathered ones."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    from ..backbones.plain import fsdp1_unit_of
    from .regional import transformer_blocks

    head = "FSDP1 (FullyShardedDataParallel)"
    units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    blocks = {id(fsdp1_unit_of(b)) for b in transformer_blocks(module)}
    others = [u for u in units if u is not module and id(u) not in blocks]
    if others:
        return (f"{head} is served per block where the wrapped module is the FullyShardedDataParallel root (wrapped "
                "after FSDP1) or the module it holds (wrapped before FSDP1), its other units the transformer "
                f"blocks'; it holds the unit {type(others[0].module).__name__}: wrap the root or the module it holds, "
                "with an auto-wrap policy per block class")
    if schedule == "reweight":
        return (f"{head} with schedule='reweight': Reweight's loss heads would run FSDP1's gathers for blocks they "
                "answer from kept outputs, which is not served yet; use schedule='retain'")
    if per_block is False:
        return f"{head} is served per block only; per_block=False keeps the whole call, whose trace FSDP1's " \
            "gathers would leave"
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        if handle._sharding_strategy not in (HandleShardingStrategy.FULL_SHARD, HandleShardingStrategy.SHARD_GRAD_OP):
            return (f"{head} with sharding_strategy={handle._sharding_strategy.name} is not served yet; use "
                    "sharding_strategy=FULL_SHARD or SHARD_GRAD_OP")
        if handle._offload_params:
            return (f"{head} with cpu_offload=CPUOffload(offload_params=True) is not served yet (FSDP1's CPU offload "
                    "needs an accelerator, and the per-block path is tested on CPU ranks); drop cpu_offload")
    unwrapped = [b for b in transformer_blocks(module) if fsdp1_unit_of(b) is None]
    if unwrapped or not transformer_blocks(module):
        return (f"{head} is served per block where each transformer block is its own unit (an auto-wrap policy per "
                f"block class); {type(unwrapped[0]).__name__ if unwrapped else 'no block'} is not")
    return None


def passed_through(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The module a data-parallel wrapper hands its calls to, where the wrapper's forward must run around each of
    them: DDP's reducer is armed there (``prepare_for_backward``; with ``find_unused_parameters`` it marks ready
    at once every parameter the output's graph does not reach, with ``static_graph`` it queues its delayed
    all-reduce). Served at DDP's level, a call would skip that forward (no gradient sync), and tracing DDP's forward
    would arm the reducer on the trace's graph, which reaches no parameter (each then marked ready twice)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "module", module.module
    return None
