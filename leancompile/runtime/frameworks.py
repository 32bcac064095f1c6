"""Frameworks that manage a module's parameters themselves, so that its calls cannot be verified: found without
importing them (a framework not imported has sharded nothing)."""
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
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return ("DeepSpeed ZeRO-3 partitions the module's parameters and gathers them inside each call; it runs "
                "natively. ZeRO-1 and ZeRO-2 (sharded gradients and optimizer states) are served")
    return None
