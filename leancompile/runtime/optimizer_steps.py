"""Every optimizer step moves the version counters of the parameters it steps.

A kept call is served only while the weights' version counters are those it was made with
(:mod:`leancompile.runtime.identity`). Fused optimizer kernels write the parameters in place without moving them:
``torch.optim.AdamW(fused=True)``, which is transformers' ``Trainer`` default (``optim="adamw_torch_fused"``, so TRL's
``GRPOTrainer``), leaves every counter where it was, and the update after the step would be served the values of the
weights before it. A post-hook on every optimizer's step moves them (a second move after an optimizer that moved
them itself is harmless: counters are only compared for equality).
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def _moved(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    torch.autograd.graph.increment_version([p for group in optimizer.param_groups for p in group["params"]])


_handle = register_optimizer_step_post_hook(_moved)
