"""Frameworks that manage a module's parameters themselves, so that its calls cannot be verified, and wrappers whose
own forward must run around every call: found without importing them (a framework not imported has sharded
nothing)."""
from __future__ import annotations

import sys

import torch


def framework_refusal(module: torch.nn.Module) -> str | None:
    """Why a framework that manages the module's parameters itself keeps it from being served (None: none does)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded by it
    if fsdp is not None and (any(isinstance(m, fsdp.FullyShardedDataParallel) for m in module.modules()) or any(
            isinstance(p, fsdp.FlatParameter) for p in module.parameters())):
        return ("FSDP1 (FullyShardedDataParallel) holds the module's parameters as flat shards it swaps in and out "
                "around each call, which the engine cannot verify; it runs natively. Shard with FSDP2's "
                "fully_shard (torch.distributed.fsdp) to be served per block")
    ddp = torch.nn.parallel.DistributedDataParallel
    if any(isinstance(m, ddp) for m in module.modules() if m is not module):
        return ("a DistributedDataParallel inside the module arms its reducer in its own forward, which the "
                "engine's program would bypass; it runs natively. Wrap the DistributedDataParallel itself, or the "
                "module it holds")
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return ("DeepSpeed ZeRO-3 partitions the module's parameters and gathers them inside each call; it runs "
                "natively. ZeRO-1 and ZeRO-2 (sharded gradients and optimizer states) are served")
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
