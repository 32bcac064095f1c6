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
from ..protocol import MicroStep, Rollout
from .meta import CALL, INPUT, PROVISIONAL, REWRITE


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
def _mark_backbone_calls(modules: dict[str, torch.nn.Module], program: str):
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


def _tag_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node.meta[INPUT] = name


def _example_inputs(trainer, rows: int):
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


def _conditioning(text, pooled) -> Conditioning:
    return Conditioning(text, pooled if pooled.shape[-1] else None)


def capture(trainer, rows: int | None = None) -> Programs:
    """Trace ``trainer``'s rollout step and update micro-step at a micro-batch of ``rows`` samples."""

    cfg = trainer.config
    rows = rows or min(cfg.train_batch_size, cfg.group_size)
    backbone = trainer.backbone
    params = dict(backbone.named_parameters())
    buffers = dict(backbone.named_buffers())
    example = _example_inputs(trainer, rows)
    modules = {"backbone": backbone}
    if getattr(trainer, "reference", None) is not None:
        modules["reference"] = trainer.reference

    def rollout_step(params, buffers, latents, cond_text, cond_pooled, rows, steps, noise):
        with _reparametrize_module(backbone, {**params, **buffers}):
            x = latents[rows, steps]
            sigma, sigma_next = trainer.sigmas[steps], trainer.sigmas[steps + 1]
            v = trainer.rollout_velocity(0, rows, x, sigma, _conditioning(cond_text, cond_pooled).index(rows))
            res = trainer.step_fn(x, v, sigma, sigma_next, cfg.noise, noise=noise)
            return res.prev_sample, res.log_prob

    def update_micro_step(params, buffers, latents, log_probs, cond_text, cond_pooled, advantages, rows, steps):
        with _reparametrize_module(backbone, {**params, **buffers}):
            rollout = Rollout([], _conditioning(cond_text, cond_pooled), latents, log_probs, trainer.sigmas,
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
        with _mark_backbone_calls(modules, program):
            gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(
                params, buffers, *(example[k] for k in data))
        _tag_placeholders(gm, names + [f"data:{k}" for k in data])
        traced[program] = gm
    return Programs(rollout=traced["rollout"], update=traced["update"])


@contextlib.contextmanager
def _marking_new_nodes(key: str, value: str):
    """Tag the nodes ``make_fx`` records inside the block with ``node.meta[key] = value``."""
    graph = get_proxy_mode().tracer.graph
    before = set(graph.nodes)
    try:
        yield
    finally:
        for node in graph.nodes:
            if node not in before:
                node.meta.setdefault(key, value)


def capture_provisional(trainer, rows: int | None = None) -> torch.fx.GraphModule:
    """Trace Reweight's rollout step: the backbone call with grad, the SDE update, the trainer's loss head at the
    provisional advantage 1 on the call's output (no second forward), and the backward into the trainable weights.

    Nodes carry ``node.meta[PROVISIONAL]``: ``"loss"`` for the head, ``"backward"`` for the backward (those also
    ``REWRITE = "inserted"``); the outputs are ``(x_next, log_prob, provisional_grad_0, ...)``.
    """
    from ..backbones.routing import calling

    cfg = trainer.config
    rows = rows or min(cfg.train_batch_size, cfg.group_size)
    backbone = trainer.backbone
    params = dict(backbone.named_parameters())
    buffers = dict(backbone.named_buffers())
    trainable = [n for n, p in params.items() if p.requires_grad]
    example = _example_inputs(trainer, rows)
    train_velocity = trainer.train_velocity

    def provisional_step(params, buffers, latents, cond_text, cond_pooled, rows, steps, noise):
        with _reparametrize_module(backbone, {**params, **buffers}):
            x = latents[rows, steps]
            sigma, sigma_next = trainer.sigmas[steps], trainer.sigmas[steps + 1]
            cond = _conditioning(cond_text, cond_pooled).index(rows)
            kept = {}

            def forward_with_grad(*args):
                with torch.enable_grad():
                    kept["output"] = backbone(*args)
                return kept["output"].detach()

            def head_velocity(micro):  # the loss head reads the kept output: no second forward
                with calling(trainer, lambda *args: kept["output"]):
                    return train_velocity(micro)

            with calling(trainer, forward_with_grad):
                v = trainer.rollout_velocity(0, rows, x, sigma, cond)
            res = trainer.step_fn(x, v, sigma, sigma_next, cfg.noise, noise=noise)
            micro = MicroStep(rows, steps, x, res.prev_sample, sigma, sigma_next, cond, res.log_prob,
                              torch.ones(len(rows), dtype=x.dtype))
            trainer.__dict__["train_velocity"] = head_velocity
            try:
                with torch.enable_grad(), _marking_new_nodes(PROVISIONAL, "loss"):
                    loss, _ = trainer.micro_step_loss(micro)
            finally:
                del trainer.__dict__["train_velocity"]
            with _marking_new_nodes(PROVISIONAL, "backward"):
                grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True,
                                            materialize_grads=True)
            return (res.prev_sample, res.log_prob, *grads)

    data = ("latents", "cond_text", "cond_pooled", "rows", "steps", "noise")
    with _mark_backbone_calls({"backbone": backbone}, "rollout"):
        gm = make_fx(provisional_step, tracing_mode="fake", _allow_non_fake_inputs=True)(
            params, buffers, *(example[k] for k in data))
    _tag_placeholders(gm, [f"param:{n}" for n in params] + [f"buffer:{n}" for n in buffers] +
                      [f"data:{k}" for k in data])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(output.args[0])
    for i, grad in enumerate(results[2:]):
        with gm.graph.inserting_before(output):
            node = gm.graph.call_function(torch.ops.aten.alias.default, (grad,))
        node.name = f"provisional_grad_{i}"
        node.meta.update(val=grad.meta.get("val"), **{REWRITE: "inserted", PROVISIONAL: trainable[i]})
        results[2 + i] = node
    output.args = (tuple(results),)
    for node in gm.graph.nodes:
        if node.meta.get(PROVISIONAL) == "backward":
            node.meta[REWRITE] = "inserted"
    gm.graph.lint()
    gm.recompile()
    return gm
