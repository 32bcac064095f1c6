"""Per-sample gradients of one batched backbone call.

Reweight needs, for every sample of a rollout micro-batch, the gradient of that sample's loss alone, while the
rollout runs the micro-batch as one batch (its trajectory must stay the native one). The call's rows are
``segments x samples`` (the CFG layout ``[uncond, cond]``): row ``r`` belongs to sample ``r % samples``. Three
methods, chosen per call:

* ``"single"``: the call holds one sample: its gradient is the batch gradient, one backward.
* ``"linear"``: every trainable parameter is the weight or bias of an ``nn.Linear`` that sees the batch on dim 0
  (LoRA's A and B matrices; most of a full fine-tune). One backward to the layers' outputs ``D``, and for each
  layer ``G_i = sum over sample i's rows and tokens of D^T X`` with the layer's recorded input ``X``: the
  per-sample gradient hooks of Opacus / ``ExpandedWeights``, at the cost of one ordinary backward.
* ``"per-sample"``: one backward per sample through the batch's graph with that sample's rows of the cotangent
  (any parameter; ``samples`` times the cost).
"""
from __future__ import annotations

import contextlib

import torch


class PerSampleGradients:
    """Per-sample gradients of ``trainable`` (parameters of ``backbone``) for calls run under :meth:`recording`."""

    def __init__(self, backbone: torch.nn.Module, trainable: list[torch.Tensor]):
        self.trainable = trainable
        index = {id(p): i for i, p in enumerate(trainable)}
        self._layers = []  # (module, weight index or None, bias index or None)
        covered = set()
        for module in backbone.modules():
            if isinstance(module, torch.nn.Linear):
                w, b = index.get(id(module.weight)), index.get(id(module.bias)) if module.bias is not None else None
                if w is not None or b is not None:
                    self._layers.append((module, w, b))
                    covered |= {w, b} - {None}
        self.linear_covers_all = len(covered) == len(trainable)
        self._records: dict[int, list] = {}
        self._rows = 0
        self._batched_dim0 = True

    @contextlib.contextmanager
    def recording(self, rows: int):
        """Record each trainable linear layer's inputs and outputs during a call over ``rows`` batch rows."""
        self._records = {i: [] for i in range(len(self._layers))}
        self._rows, self._batched_dim0 = rows, True
        handles = []
        if self.linear_covers_all:
            for i, (module, _, _) in enumerate(self._layers):
                handles.append(module.register_forward_hook(self._hook(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, i):
        def hook(module, args, output):
            x = args[0]
            if x.shape[0] != self._rows or output.shape[0] != self._rows:
                self._batched_dim0 = False
                return
            if torch.is_autocast_enabled(x.device.type):  # the layer multiplied the input cast to this dtype
                x = x.to(torch.get_autocast_dtype(x.device.type))
            self._records[i].append((x.detach(), output))
        return hook

    def method(self, samples: int) -> str:
        if samples == 1:
            return "single"
        return "linear" if self.linear_covers_all and self._batched_dim0 else "per-sample"

    def gradients(self, output: torch.Tensor, cotangent: torch.Tensor, samples: int,
                  retain_graph: bool = False) -> list[torch.Tensor]:
        """``[(samples, *p.shape) for p in trainable]``: each sample's share of ``d<output, cotangent>/dp``."""
        method = self.method(samples)
        if method == "single":
            grads = torch.autograd.grad(output, self.trainable, cotangent, retain_graph=retain_graph,
                                        allow_unused=True, materialize_grads=True)
            return [g.unsqueeze(0) for g in grads]
        if method == "linear":
            return self._linear_gradients(output, cotangent, samples, retain_graph)
        rows = torch.arange(output.shape[0], device=output.device) % samples
        per_sample = []
        for i in range(samples):
            mask = (rows == i).to(cotangent.dtype).view(-1, *[1] * (cotangent.dim() - 1))
            per_sample.append(torch.autograd.grad(output, self.trainable, cotangent * mask, retain_graph=True,
                                                  allow_unused=True, materialize_grads=True))
        return [torch.stack(gs) for gs in zip(*per_sample)]

    def _linear_gradients(self, output, cotangent, samples, retain_graph):
        records = [(i, x, y) for i, calls in self._records.items() for x, y in calls]
        d_outputs = torch.autograd.grad(output, [y for _, _, y in records], cotangent, retain_graph=retain_graph,
                                        allow_unused=True, materialize_grads=True)
        grads = [torch.zeros(samples, *p.shape, dtype=p.dtype, device=p.device) for p in self.trainable]
        segments = self._rows // samples
        for (i, x, _), d in zip(records, d_outputs):
            _, w, b = self._layers[i]
            dtype = self.trainable[w if w is not None else b].dtype
            # (segments, samples, tokens, features): the sample's rows and tokens are summed over.
            d = d.to(dtype).reshape(segments, samples, -1, d.shape[-1])
            if w is not None:
                x = x.to(dtype).reshape(segments, samples, -1, x.shape[-1])
                grads[w] += torch.einsum("sbto,sbti->boi", d, x)
            if b is not None:
                grads[b] += d.sum(dim=(0, 2))
        return grads
