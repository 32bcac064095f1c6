"""Reweight's rollout step, traced for inspection: the backbone call with grad, the loss head at the provisional
advantage on its output, and the backward into the trainable weights.

Before::

    trainer.rollout_velocity(...) ; trainer.step_fn(...)          # the rollout step, eager Python

After::

    GraphModule(params..., buffers..., latents, cond_text, ..., rows, steps, noise)
        -> (x_next, log_prob, provisional_grad_0, ...)
"""
from __future__ import annotations

import contextlib

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module

from ..protocol import MicroStep
from .capture import conditioning_of, example_inputs, marking_backbone_calls, tag_placeholders
from .meta import PARAMETER, PROVISIONAL, REWRITE, Provisional, Rewrite


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

    Nodes carry ``node.meta[PROVISIONAL]``: ``Provisional.LOSS`` for the head, ``BACKWARD`` for the backward (those
    also ``REWRITE = Rewrite.INSERTED``), ``GRADIENT`` for the outputs (``PARAMETER`` names their weight); the
    outputs are ``(x_next, log_prob, provisional_grad_0, ...)``.
    """
    from ..backbones.routing import calling

    cfg = trainer.config
    rows = rows or min(cfg.train_batch_size, cfg.group_size)
    backbone = trainer.backbone
    params = dict(backbone.named_parameters())
    buffers = dict(backbone.named_buffers())
    trainable = [n for n, p in params.items() if p.requires_grad]
    example = example_inputs(trainer, rows)
    train_velocity = trainer.train_velocity

    def provisional_step(params, buffers, latents, cond_text, cond_pooled, rows, steps, noise):
        with _reparametrize_module(backbone, {**params, **buffers}):
            x = latents[rows, steps]
            sigma, sigma_next = trainer.sigmas[steps], trainer.sigmas[steps + 1]
            cond = conditioning_of(cond_text, cond_pooled).index(rows)
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
                with torch.enable_grad(), _marking_new_nodes(PROVISIONAL, Provisional.LOSS):
                    loss, _ = trainer.micro_step_loss(micro)
            finally:
                del trainer.__dict__["train_velocity"]
            with _marking_new_nodes(PROVISIONAL, Provisional.BACKWARD):
                grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True,
                                            materialize_grads=True)
            return (res.prev_sample, res.log_prob, *grads)

    data = ("latents", "cond_text", "cond_pooled", "rows", "steps", "noise")
    with marking_backbone_calls({"backbone": backbone}, "rollout"):
        gm = make_fx(provisional_step, tracing_mode="fake", _allow_non_fake_inputs=True)(
            params, buffers, *(example[k] for k in data))
    tag_placeholders(gm, [f"param:{n}" for n in params] + [f"buffer:{n}" for n in buffers] +
                      [f"data:{k}" for k in data])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(output.args[0])
    for i, grad in enumerate(results[2:]):
        with gm.graph.inserting_before(output):
            node = gm.graph.call_function(torch.ops.aten.alias.default, (grad,))
        node.name = f"provisional_grad_{i}"
        node.meta.update(val=grad.meta.get("val"), **{REWRITE: Rewrite.INSERTED, PROVISIONAL: Provisional.GRADIENT,
                                                        PARAMETER: trainable[i]})
        results[2 + i] = node
    output.args = (tuple(results),)
    for node in gm.graph.nodes:
        if node.meta.get(PROVISIONAL) is Provisional.BACKWARD:
            node.meta[REWRITE] = Rewrite.INSERTED
    gm.graph.lint()
    gm.recompile()
    return gm
