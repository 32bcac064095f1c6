"""Capture: trace the rollout step and the update micro-step of a trainer into aten-level FX graphs.

Both programs are traced with ``make_fx`` on fake tensors, as functions of the backbone's parameters and
buffers (placeholders named after them) and of the rollout's buffers (latents, log-probs, conditioning,
advantages) gathered by row and step index. Each backbone call leaves its mark: the nodes it created carry
``node.meta["leancompile.call"]``, a :class:`BackboneCall` saying which module ran, in which mode, precision and
grad mode. Placeholders carry ``node.meta["leancompile.input"]``: ``"param:<name>"``, ``"buffer:<name>"`` or
``"data:<name>"``.

Before::

    trainer.rollout_velocity(...) ; trainer.step_fn(...)          # eager Python
    trainer.micro_step_loss(trainer.micro_step(...))

After::

    rollout: GraphModule(params..., buffers..., latents, cond_text, ..., rows, steps, noise) -> (x_next, log_prob)
    update:  GraphModule(params..., buffers..., latents, log_probs, ..., rows, steps) -> loss
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module

from ..backbones import Conditioning
from ..protocol import Rollout
from .meta import CALL, INPUT


@dataclass(frozen=True)
class BackboneCall:
    """One call of a backbone module during tracing."""

    program: str  # "rollout" | "update"
    index: int  # order of the call within its program
    module: str  # "backbone" or "reference" (the frozen copy kept for the KL of full fine-tuning)
    grad_enabled: bool
    training: bool
    autocast: str | None  # the autocast dtype, or None
    adapters_enabled: bool  # False when peft adapters were disabled for this call (the LoRA reference)


@dataclass(frozen=True)
class Programs:
    """The traced rollout step and update micro-step."""

    rollout: torch.fx.GraphModule
    update: torch.fx.GraphModule


def _adapters_enabled(module: torch.nn.Module) -> bool:
    layers = [m for m in module.modules() if hasattr(m, "disable_adapters") and hasattr(m, "lora_A")]
    return not layers or not all(m.disable_adapters for m in layers)


@contextlib.contextmanager
def marking_backbone_calls(modules: dict[str, torch.nn.Module], program: str):
    """Tag the graph nodes each module call creates while ``make_fx`` traces."""
    calls = []

    def pre_hook(name):
        def hook(module, args):
            graph = get_proxy_mode().tracer.graph
            calls.append(set(graph.nodes))
        return hook

    def post_hook(name):
        def hook(module, args, output):
            graph = get_proxy_mode().tracer.graph
            before = calls.pop()
            autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
            call = BackboneCall(
                program=program,
                index=post_hook.count,
                module=name,
                grad_enabled=torch.is_grad_enabled(),
                training=module.training,
                autocast=str(autocast).replace("torch.", "") if autocast is not None else None,
                adapters_enabled=_adapters_enabled(module),
            )
            post_hook.count += 1
            for node in graph.nodes:
                if node not in before and CALL not in node.meta:
                    node.meta[CALL] = call
        return hook

    post_hook.count = 0
    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(pre_hook(name)))
        handles.append(module.register_forward_hook(post_hook(name)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def tag_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node.meta[INPUT] = name


def example_inputs(trainer, rows: int):
    """A rollout-shaped example: ``rows`` samples, every step stored, conditioning from the backbone."""
    cfg = trainer.config
    bb = trainer.backbone
    on = dict(dtype=trainer.dtype, device=trainer.device)
    latents = torch.zeros(rows, cfg.num_steps + 1, *bb.latent_shape, **on)
    cond = bb.dummy_conditioning(rows, generator=torch.Generator().manual_seed(0), dtype=trainer.dtype)
    return {
        "latents": latents,
        "log_probs": torch.zeros(rows, cfg.num_steps, **on),
        "cond_text": cond.text,
        "cond_pooled": cond.pooled if cond.pooled is not None else torch.zeros(rows, 0, **on),
        "advantages": torch.ones(rows, **on),
        "rows": torch.arange(rows, device=trainer.device),
        "steps": torch.zeros(rows, dtype=torch.long, device=trainer.device),
        "noise": torch.zeros(rows, *bb.latent_shape, **on),
    }


def conditioning_of(text, pooled) -> Conditioning:
    return Conditioning(text, pooled if pooled.shape[-1] else None)


def capture(trainer, rows: int | None = None) -> Programs:
    """Trace ``trainer``'s rollout step and update micro-step at a micro-batch of ``rows`` samples."""

    cfg = trainer.config
    rows = rows or min(cfg.train_batch_size, cfg.group_size)
    backbone = trainer.backbone
    params = dict(backbone.named_parameters())
    buffers = dict(backbone.named_buffers())
    example = example_inputs(trainer, rows)
    modules = {"backbone": backbone}
    if getattr(trainer, "reference", None) is not None:
        modules["reference"] = trainer.reference

    def rollout_step(params, buffers, latents, cond_text, cond_pooled, rows, steps, noise):
        with _reparametrize_module(backbone, {**params, **buffers}):
            x = latents[rows, steps]
            sigma, sigma_next = trainer.sigmas[steps], trainer.sigmas[steps + 1]
            v = trainer.rollout_velocity(0, rows, x, sigma, conditioning_of(cond_text, cond_pooled).index(rows))
            res = trainer.step_fn(x, v, sigma, sigma_next, cfg.noise, noise=noise)
            return res.prev_sample, res.log_prob

    def update_micro_step(params, buffers, latents, log_probs, cond_text, cond_pooled, advantages, rows, steps):
        with _reparametrize_module(backbone, {**params, **buffers}):
            rollout = Rollout([], conditioning_of(cond_text, cond_pooled), latents, log_probs, trainer.sigmas,
                              torch.ones(cfg.num_steps, dtype=torch.bool))
            loss, _ = trainer.micro_step_loss(trainer.micro_step(rollout, advantages, rows, steps))
            return loss

    names = [f"param:{n}" for n in params] + [f"buffer:{n}" for n in buffers]
    traced = {}
    for program, fn, data in (
        ("rollout", rollout_step, ("latents", "cond_text", "cond_pooled", "rows", "steps", "noise")),
        ("update", update_micro_step,
         ("latents", "log_probs", "cond_text", "cond_pooled", "advantages", "rows", "steps")),
    ):
        with marking_backbone_calls(modules, program):
            gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(
                params, buffers, *(example[k] for k in data))
        tag_placeholders(gm, names + [f"data:{k}" for k in data])
        traced[program] = gm
    return Programs(rollout=traced["rollout"], update=traced["update"])
