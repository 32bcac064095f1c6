"""Correction nodes: once the advantages are known, scale Reweight's gradient buffers and sum them into the
weights' gradients.

Each correction is a small function of the buffers and the per-sample (or per-group) coefficients, traced with
``make_fx`` once per shape and executed as that GraphModule; the last one run is kept for inspection, its nodes
named after what they do and marked ``node.meta[REWRITE] = "inserted"``.

Per sample::

    grad_p += sum_i (w_i A_i) dP_i[p] + sum_i w_i dF_i[p]

Per group (moment accumulators, ``C_g = sum (r_i - r0) dP_i``, ``S_g = sum dP_i``)::

    grad_p += sum_g  w / (std_g + eps) * (C_g[p] - (mean_g - r0_g) * S_g[p])  +  sum_g w_g dF_g[p]
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..passes.meta import REWRITE

_NAMES = {"mv.default": "sum_scaled_buffers", "mul.Tensor": "shift_by_group_mean", "sub.Tensor": "centre_on_group_mean",
          "add.Tensor": "add_advantage_free_terms"}


def _weighted_sum(buffers: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    n = buffers.shape[0]
    return torch.mv(buffers.reshape(n, -1).t(), coefficients.to(buffers.dtype)).view(buffers.shape[1:])


def per_sample_correction(advantage_weights, weights, policy, free):
    grads = []
    for j, buffers in enumerate(policy):
        grad = _weighted_sum(buffers, advantage_weights)
        if free is not None:
            grad = grad + _weighted_sum(free[j], weights)
        grads.append(grad)
    return grads


def moment_correction(scale, shift, trained, centred, plain, free):
    grads = []
    for j, (c, s) in enumerate(zip(centred, plain)):
        centred_on_mean = c - shift.to(c.dtype).view(-1, *[1] * (c.dim() - 1)) * s
        grad = _weighted_sum(centred_on_mean, scale)
        if free is not None:
            grad = grad + _weighted_sum(free[j], trained)
        grads.append(grad)
    return grads


class Correction:
    """Runs the traced corrections for ``trainable``'s gradients; ``graph`` is the last one run."""

    def __init__(self, trainable):
        self.trainable = trainable
        self._traced: dict = {}
        self.graph: torch.fx.GraphModule | None = None

    def per_sample(self, advantage_weights, weights, policy, free) -> list[torch.Tensor]:
        return self._run(per_sample_correction, (advantage_weights, weights, policy, free),
                         ("advantage_weights", "sample_weights", "provisional_policy_grads", "provisional_free_grads"))

    def moments(self, scale, shift, trained, centred, plain, free) -> list[torch.Tensor]:
        return self._run(moment_correction, (scale, shift, trained, centred, plain, free),
                         ("group_scales", "group_mean_shifts", "group_weights", "moment_reward_weighted_grads",
                          "moment_grads", "moment_free_grads"))

    def _run(self, fn, args, names):
        key = (fn.__name__, *(None if a is None else tuple(t.shape for t in (a if isinstance(a, list) else [a]))
                              for a in args))
        if key not in self._traced:
            self._traced[key] = _trace(fn, args, names)
        self.graph = self._traced[key]
        return self.graph(*args)


def _trace(fn, args, names) -> torch.fx.GraphModule:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    placeholders = iter(n for n in gm.graph.nodes if n.op == "placeholder")
    for name, arg in zip(names, args):
        for i in range(0 if arg is None else len(arg) if isinstance(arg, list) else 1):
            node = next(placeholders)
            node.name = name if not isinstance(arg, list) else f"{name}_{i}"
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            base = _NAMES.get(f"{node.target._opname}.{node.target._overloadname}", None)
            if base is not None:
                counts[base] = counts.get(base, -1) + 1
                node.name = f"{base}_{counts[base]}"
            node.meta[REWRITE] = "inserted"
    gm.graph.lint()
    gm.recompile()
    return gm
