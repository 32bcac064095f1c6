"""The watch over wrapped modules: at each optimizer step over a wrapped module's weights its runtime looks back at
the calls since the previous step and warns once per cause, with the fix, where none was served
(:class:`NothingServedWarning`); and a counter of every tensor or submodule registered anywhere, so that a wrapped
module whose parameters a framework replaced (FSDP1 flattening them, peft adding adapters) looks again."""
from __future__ import annotations

import weakref

import torch
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..backbones.plain import zero3_partitioned
from ..runtime.identity import TRAINING_FLAGS
from .wrapped import RUNTIME


class NothingServedWarning(UserWarning):
    """An optimizer step followed calls with grad of a wrapped module and none of them was served."""


class NothingServedError(RuntimeError):
    """:class:`NothingServedWarning` raised as an error (``wrap(..., strict=True)``)."""


# What to do about each kind of recompute reason, for the warning of a loop that gains nothing.
FIXES = {
    "nothing kept": "no call without grad was kept before the update: the rollout must call the module under "
                    "torch.no_grad() on the rows the update trains (check the trained= hint and memory_limit)",
    "inputs": "the update's call differs from the rollout's in an argument (see last_calls): pass it the rollout's "
              "own tensors, in the same dtype",
    TRAINING_FLAGS: "the rollout and the update run the module in different modes and a submodule computes "
                    "differently in the two (dropout with p > 0): run both in one mode, or set that p to 0",
    "weights": "the weights were written between the rollout and the update (an optimizer step, load_state_dict): "
               "only the update's calls before the first optimizer step after a rollout can be served",
    "written": "weights were written through .data or another alias between the rollout and the update (a reference "
               "or EMA swapped in): a call made while they are swapped in recomputes; swap them back before the "
               "update's calls",
    "freed": "the kept calls were freed before the update (see the reason)",
    "autocast": "the update runs under another autocast state than the rollout: use the same one in both",
    "module state": "adapters or requires_grad differ between the rollout and the update (a KL reference runs "
                    "natively by design)",
    "arguments": "an argument is neither a tensor nor a constant",
    "cotangent": "the update's loss is not in the span of the provisional head's: hand provisional() the update's "
                 "own loss",
    "used": "each kept row serves one call with grad before an optimizer step: the update ran the same rows twice",
    "unsupported": "see the reason",
}


# Bumped whenever any module registers a parameter, buffer or submodule: a wrapped module whose own tensors may
# have changed (FSDP1 flattening them, peft adding adapters) looks again at its next call.
REGISTRATIONS = [0]


def _registered(*_):
    REGISTRATIONS[0] += 1


_OPTIMIZER_HOOK = []


def watch(module: torch.nn.Module) -> None:
    """Register the module for the optimizer-step watch (one global hook for every wrapped module)."""
    _WATCHED.add(module)
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_optimizer_step))
        for register in (register_module_parameter_registration_hook, register_module_buffer_registration_hook,
                         register_module_module_registration_hook):
            register(_registered)


_WATCHED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _optimizer_step(optimizer, *_):
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # DeepSpeed ZeRO-3's optimizer steps its flat partitions (tensors it gives a ds_id), which no parameter names:
    # a step over one is taken as a step over every module ZeRO-3 partitioned
    partitions = any(zero3_partitioned(p) for group in optimizer.param_groups for p in group["params"])
    for module in list(_WATCHED):
        runtime = module.__dict__.get(RUNTIME)
        if runtime is not None and runtime.watched and (
                any(id(p) in stepped for p in runtime.trainable) or (partitions and runtime.partitioned)):
            runtime.stepped()
