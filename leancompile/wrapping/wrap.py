"""``leancompile.wrap(module)``: the reuse engine around a module called from a training loop leancompile did not
write (a diffusers transformer in a FlowGRPO- or DanceGRPO-style script, a causal LM in a GRPO loop).

The loop stays as it is. Its rollout calls the module without grad; each such call that matches no kept call is
kept (run through the per-row program, its saved tensors held) while what the kept calls hold stays under the
memory limit. The rollout ends at the first call with grad (calls without grad after it, such as a KL reference
with the adapters off, are not kept) and a new one begins once the weights change. Its update calls the module
again with grad: a call whose every row has a kept row with bitwise-equal inputs and the same state (weights
unmodified, training flags, adapters, autocast) is served from it, and its backward runs the kept rows' backward;
anything else runs the module itself, and ``stats()`` says why. An optimizer step changes the weights' version
counters, so nothing kept before it is served after it, and it is freed at the next call.

With ``schedule="reweight"`` the loop also hands the update's loss to ``wrapped.provisional(head)`` once the
rollout's calls are made: the kept calls' per-row gradients are computed from it then, their activations freed,
and each served call's backward combines them with the coefficients its true cotangent has in their span (a
cotangent outside it recomputes: :mod:`leancompile.runtime.reweight`).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..backbones.plain import WRAPPED_CLASS
from ..request import SHARED_ARGUMENTS, Request
from .watch import NothingServedError, NothingServedWarning
from .wrap_runtime import attach
from .wrapped import RUNTIME, Wrapped

__all__ = ["NothingServedError", "NothingServedWarning", "Wrapped", "unwrap", "wrap"]


def wrap(module: torch.nn.Module, schedule: str = "retain", memory_limit: int | None = None,
         shared: tuple[str, ...] = SHARED_ARGUMENTS, tune_matmuls: bool = True, bitwise: bool = False,
         per_block: bool | None = None, trained: Callable[[int], bool] | None = None,
         strict: bool = False, verify: str = "values") -> Wrapped:
    """Wrap ``module`` so that its calls with grad are served from its earlier calls without grad where that is
    verified to compute the same thing.

    Args:
        module: any ``nn.Module`` whose output rows depend only on the same rows of its inputs (a diffusers
            transformer, with or without peft LoRA; a causal LM called on whole sequences), called with its own
            arguments. Its output must be tensors with the call's rows first, of one dtype, and constants, in any
            tree (``return_dict=False``'s tuple, a model output without a cache: pass ``use_cache=False`` to a
            causal LM).
        schedule: ``"retain"`` keeps the kept calls' activations on the device, ``"offload"`` in host memory;
            ``"reweight"`` turns them into per-row gradients when the loop calls ``wrapped.provisional(head)``;
            ``"auto"`` retains while the kept calls fit in ``memory_limit``, then offloads where the device has a
            memory of its own (CUDA: the host's has room), else runs the rest natively.
        memory_limit: bytes the kept calls may hold on the device (default: half the device's free memory at the
            first call).
        shared: keyword arguments that every row shares whatever their leading size (tensors whose leading size
            differs from the batch's are shared anyway).
        tune_matmuls: as in :func:`leancompile.optimize`.
        bitwise: ``schedule="retain"`` keeping the module's own eager autograd graph (:mod:`leancompile.runtime.bitwise`):
            the loop's run is native's bit for bit in any precision; an update call is served only when it holds
            exactly one kept call's rows in their order.
        per_block: keep and serve each transformer block's calls through an engine of its own while the rest of
            the module runs natively (:mod:`leancompile.runtime.regional`; the blocks are the module's stacks of
            identical blocks, :func:`~leancompile.runtime.regional.transformer_blocks`), so that FSDP2's per-block
            gathers and reduce-scatters run as they do natively: a module sharded with ``fully_shard`` is never
            gathered whole. ``None``: per block when a submodule of ``module`` is sharded by FSDP2. Not with
            ``bitwise=True``; under Reweight each block keeps its per-row gradients as FSDP2 gathers them (whole
            per block, unreduced: see :mod:`leancompile.runtime.reweight_blocks`).
        trained: a hint where the loop knows which of a rollout's calls its update will train: ``trained(n)`` for
            the rollout's n-th call without grad (from 0, counted from the first call after the weights changed),
            False for a call that is not to be kept (FlowGRPO's steps past the first k of each sample batch:
            ``lambda n: n % num_steps < k``). None: every call is kept while they fit (DanceGRPO draws its trained
            steps after the rollout).
        strict: raise :class:`NothingServedError` where the warning :class:`NothingServedWarning` would be given
            (an optimizer step after calls with grad none of which was served), e.g. in CI.
        verify: ``"values"``: every answer (a served call, a served value) compares a digest of the weights'
            values with the one its kept call was made with (:mod:`leancompile.runtime.digest`: every write is
            seen, through ``.data`` or an alias too; it reads the weights once per kept call and per answer).
            ``"versions"``: their version counters alone, which trusts that nothing writes the weights through
            ``.data`` or another alias between a kept call and its answers (no reference or EMA swapped in).

    Returns:
        The module itself, its class put behind :class:`Wrapped` (``isinstance`` holds, its ``state_dict`` keys
        are its own); wrap it before or after DDP, FSDP2, FSDP1, DeepSpeed, accelerate's ``prepare`` or peft.
        FSDP1 and ZeRO-3, which manage the parameters themselves, are served per block where each block is their
        unit (an FSDP1 unit, a ZeRO-3 leaf module); otherwise the module runs natively, and ``stats()`` says why.
    """
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module; got {type(module).__name__}")
    if isinstance(module, Wrapped):
        raise ValueError("module is already wrapped: wrap it once (leancompile.unwrap(module) undoes it)")
    request = Request(schedule, "wrap", memory_limit=memory_limit, per_block=per_block, tune_matmuls=tune_matmuls,
                      bitwise=bitwise, shared=tuple(shared) if not isinstance(shared, str) else shared,
                      trained=trained, raises=strict, verify=verify)
    runtime = attach(module, request)
    if runtime.refusal is not None:
        warnings.warn(f"leancompile.wrap: {runtime.refusal}", NothingServedWarning, stacklevel=2)
    return module


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`wrap`: the module's own class again, nothing kept. Returns the module."""
    if RUNTIME not in module.__dict__:
        raise ValueError(f"unwrap: {type(module).__name__} is not wrapped by leancompile.wrap")
    if not type(module).__dict__.get(WRAPPED_CLASS):
        raise ValueError(f"unwrap: {type(module).__name__} was given another class since it was wrapped (FSDP2's "
                         "fully_shard): unwrap it before that")
    runtime = module.__dict__.pop(RUNTIME)
    runtime.engine.release()
    if runtime.below is not None:
        unwrap(runtime.below[1])
    module.__class__ = type(module).__bases__[-1]
    return module
