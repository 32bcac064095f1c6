"""A wrapped module's structure is read when it is called, not when it was wrapped: wrapping before a framework
changes the module (torch's checkpoint wrapper around each block, diffusers' gradient checkpointing,
``torch.compile``, peft) serves as wrapping after it. The rollout runs in ``eval()`` without grad, the update in
``train()`` with grad, and its gradients are an unwrapped copy's, changed alike."""
import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)

import leancompile
from leancompile import backbones


def _inputs(backbone, rows: int = 2) -> dict:
    text = backbone.dummy_conditioning(rows, torch.Generator().manual_seed(1), dtype=torch.float64)
    latents = torch.randn(rows, *backbone.latent_shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)
    inputs = dict(hidden_states=latents, timestep=torch.linspace(500.0, 100.0, rows, dtype=torch.float64),
                  encoder_hidden_states=text.text)
    if text.pooled is not None:
        inputs["pooled_projections"] = text.pooled
    return inputs


def _loop(module, inputs: dict) -> torch.Tensor:
    """A DanceGRPO-style step: the rollout in eval() without grad, the update in train() with grad."""
    module.eval()
    with torch.no_grad():
        module(**inputs, return_dict=False)
    module.train()
    module.zero_grad(set_to_none=True)
    module(**inputs, return_dict=False)[0].square().sum().backward()
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.requires_grad])


def checkpointed(module):
    """Each transformer block under torch's checkpoint wrapper, as DanceGRPO's ``apply_fsdp_checkpointing`` puts
    it: the blocks' parameters keep their tensors and change their names."""
    block = type(leancompile.runtime.regional.transformer_blocks(module)[0])
    apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, block), checkpoint_wrapper_fn=(
        functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)))
    return module


def gradient_checkpointing(module):
    module.enable_gradient_checkpointing()
    return module


def lora(module):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the adapters drawn alike for the wrapped module and its copy
    return get_peft_model(module, LoraConfig(r=2, target_modules=["to_q", "to_v"], init_lora_weights=False))


def compiled(module):
    return torch.compile(module, backend="eager")


def _served_as_its_copy(family: str, change, rtol: float):
    module = backbones.tiny(family, seed=0, dtype=torch.float64).model
    native = change(copy.deepcopy(module))
    wrapped = leancompile.wrap(module)
    called = change(wrapped)  # what the loop then calls (an OptimizedModule, a PeftModel: around the module)
    inputs = _inputs(backbones.tiny(family, seed=0, dtype=torch.float64))
    grads = _loop(called, inputs)
    stats = wrapped.stats()
    assert stats["served_calls"] > 0 and stats["recomputed_calls"] == 0, stats
    expected = _loop(native, inputs)
    torch.testing.assert_close(grads, expected, rtol=rtol, atol=rtol * expected.abs().max())


@pytest.mark.fast
def test_blocks_put_under_a_checkpoint_wrapper_after_wrapping_are_served():
    """Wan's blocks hold a parameter of their own (``scale_shift_table``), which the program reads by its name. Wan's
    blocks compute in float32 whatever the module's dtype (``.float()``): its gradient is native's to that."""
    _served_as_its_copy("wan", checkpointed, rtol=1e-5)


@pytest.mark.parametrize("change", [checkpointed, gradient_checkpointing, compiled, lora])
def test_a_module_changed_after_wrapping_is_served_as_if_wrapped_after(change):
    _served_as_its_copy("sd3", change, rtol=1e-10)
