"""How a data-parallel framework lays a model's weights out per rank, as the planner prices it: what each rank keeps
of the weights, gradients and optimizer state, which weights it gathers when, and whether leancompile serves the
update per block under it (runtime.regional) or runs it natively."""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Refusal, Schedule


@dataclass(frozen=True)
class Sharding:
    """One framework's layout. Under a sharded layout each rank keeps ``1/world`` of the weights, gradients and
    optimizer state and gathers a block's whole weights around the block's calls."""

    name: str  # as the command line and ``Scenario.sharding`` name it
    label: str  # as the plan prints it
    sharded: bool  # weights, gradients and optimizer state partitioned over the ranks (else replicated)
    # All-gathers of each block's weights per update call: its forward's and again its backward's (2), or its
    # forward's alone, the gathered weights kept through the backward (1)
    gathers_per_update: int = 0
    in_flight: int = 0  # blocks whose gathered weights are held at once (the running one and the prefetched one)
    held_through_backward: bool = False  # every block's gathered weights held from its forward to its backward
    whole_call: bool = False  # a whole-call partition may run on the gathered weights (trainers.parallel)
    refusals: tuple[Refusal, ...] = ()  # the schedules leancompile does not serve under it, and why

    def refused(self, world: int) -> tuple[Refusal, ...]:
        """The schedules not served on ``world`` ranks (on one rank nothing is sharded)."""
        return self.refusals if self.sharded and world > 1 else ()

    def gathered_bytes(self, whole: int, blocks: int, world: int) -> int:
        """Bytes of gathered weights a rank holds at once during an update call, besides its own shard, where the
        blocks' whole weights take ``whole`` bytes: the blocks in flight, or every block from its forward to its
        backward (a gathered block is a buffer of its own; the shard stays). None on one rank, or unsharded."""
        if not self.sharded or world == 1:
            return 0
        return whole if self.held_through_backward else whole * min(self.in_flight, blocks) // max(blocks, 1)


_FSDP1_REWEIGHT = Refusal(Schedule.REWEIGHT, "under FSDP1 Reweight's loss heads would run FSDP1's gathers for blocks "
                                              "they answer from kept outputs, which is not served yet")
_ZERO3_REWEIGHT = Refusal(Schedule.REWEIGHT, "under ZeRO-3 Reweight's loss heads would run ZeRO-3's gathers for "
                                             "blocks they answer from kept outputs, which is not served yet")

# FSDP2 (fully_shard, reshard_after_forward=True) prefetches the next block's all-gather while one runs; FSDP1's
# FULL_SHARD gathers each unit's flat parameter in its forward and again in its backward (backward prefetch of the
# next unit); SHARD_GRAD_OP keeps the flat parameters gathered from the forward through the backward; ZeRO-3 gathers
# each leaf module's parameters (a block's whole tree, where the blocks are ZeRO-3 leaf modules, as leancompile
# serves it) in its forward hooks and again before its backward, prefetching the next ones.
SHARDINGS = {s.name: s for s in (
    Sharding("ddp", "DDP", sharded=False),
    Sharding("fsdp", "FSDP2", sharded=True, gathers_per_update=2, in_flight=2, whole_call=True),
    Sharding("fsdp1", "FSDP1 FULL_SHARD", sharded=True, gathers_per_update=2, in_flight=2,
             refusals=(_FSDP1_REWEIGHT,)),
    Sharding("fsdp1-grad-op", "FSDP1 SHARD_GRAD_OP", sharded=True, gathers_per_update=1, held_through_backward=True,
             refusals=(_FSDP1_REWEIGHT,)),
    Sharding("zero3", "DeepSpeed ZeRO-3", sharded=True, gathers_per_update=2, in_flight=2,
             refusals=(_ZERO3_REWEIGHT,)),
)}


def sharding(name: str) -> Sharding:
    """The layout named ``name``; a clear error naming the known ones."""
    if name not in SHARDINGS:
        raise ValueError(f"sharding must be one of {sorted(SHARDINGS)}; got {name!r}")
    return SHARDINGS[name]
