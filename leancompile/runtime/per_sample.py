"""Per-sample gradients of one batched backbone call.

Reweight needs, for every sample of a rollout micro-batch, the gradient of that sample's loss alone, while the
rollout runs the micro-batch as one batch (its trajectory must stay the native one). The call's rows are
``segments x samples`` (the CFG layout ``[uncond, cond]``): row ``r`` belongs to sample ``r % samples``. Four
methods, chosen per call:

* ``"rows"``: every trainable parameter is a linear layer's weight (LoRA): the call runs as the AOTAutograd
  partition, whose backward graph :func:`~leancompile.passes.per_row.split_weight_gradients_per_row` rewrote to
  hand over each row's share of every weight gradient. One compiled forward and backward.
* ``"single"``: the call holds one sample: its gradient is the batch gradient; the call runs as the plain
  partition, one backward.
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

from ..passes.per_row import PerRowGradients, register_sink, split_weight_gradients_per_row
from .partition import PartitionedBackbone, without_checkpointing


def trainable_linear_layers(backbone: torch.nn.Module, trainable: list[torch.Tensor]) -> tuple[list, bool]:
    """The ``nn.Linear`` layers owning trainable parameters, as ``(module, weight index, bias index)`` into
    ``trainable`` (None where frozen), and whether they own every trainable parameter."""
    index = {id(p): i for i, p in enumerate(trainable)}
    layers, covered = [], set()
    for module in backbone.modules():
        if isinstance(module, torch.nn.Linear):
            w, b = index.get(id(module.weight)), index.get(id(module.bias)) if module.bias is not None else None
            if w is not None or b is not None:
                layers.append((module, w, b))
                covered |= {w, b} - {None}
    return layers, len(covered) == len(trainable)


class PerSampleGradients:
    """Per-sample gradients of ``trainable`` (parameters of ``backbone``) for calls run by :meth:`forward`."""

    def __init__(self, backbone: torch.nn.Module, trainable: list[torch.Tensor], tune_matmuls: bool = True):
        self.backbone = backbone
        self.trainable = trainable
        self._layers, self.linear_covers_all = trainable_linear_layers(backbone, trainable)
        self._records: dict[int, list] = {}
        self._rows = 0
        self._batched_dim0 = True
        self._method: str | None = None
        self.weights_only = self.linear_covers_all and all(b is None for _, _, b in self._layers)
        self.whole = PartitionedBackbone(backbone, tune_matmuls=tune_matmuls)
        self.partitioned = None
        if self.weights_only:
            order = {id(p): position for position, p in enumerate(backbone.parameters())}
            positions = {order[id(p)]: j for j, p in enumerate(trainable)}
            self._per_row = PerRowGradients()
            token = register_sink(self._per_row)
            self.refused: dict[int, str] = {}  # rows -> why the backward graph could not be split per row
            self.split: set[int] = set()
            self.partitioned = PartitionedBackbone(backbone, backward_pass=lambda gm, rows: self._split(
                gm, rows, positions, token), tune_matmuls=tune_matmuls)

    def _split(self, gm, rows, positions, token):
        reason = split_weight_gradients_per_row(gm, positions, rows, token)
        if reason is None:
            self.split.add(rows)
        else:
            self.refused[rows] = reason
        return gm

    def forward(self, x, sigma, cond, samples: int) -> torch.Tensor:
        """Run the call (``samples`` samples) with grad in a way :meth:`gradients` can split per sample."""
        rows = x.shape[0]
        if samples == 1:  # its gradient is the batch's: the plain partition, nothing to split
            self._method = "single"
            return self.whole(x, sigma, cond)
        if self.partitioned is not None and rows not in self.refused:
            self._method = "rows"
            return self.partitioned(x, sigma, cond)
        self._method = None
        with without_checkpointing(self.backbone.model), self.recording(rows):
            return self.backbone(x, sigma, cond)

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
        if self._method in ("rows", "single"):
            return self._method
        if samples == 1:
            return "single"
        return "linear" if self.linear_covers_all and self._batched_dim0 else "per-sample"

    def gradients(self, output: torch.Tensor, cotangent: torch.Tensor, samples: int,
                  retain_graph: bool = False) -> list[torch.Tensor]:
        """``[(samples, *p.shape) for p in trainable]``: each sample's share of ``d<output, cotangent>/dp``."""
        method = self.method(samples)
        if method == "rows":
            rows = output.shape[0]
            self._per_row.clear()
            verified = rows in self.split  # else this backward compiles (and splits, or not) the graph
            grads = torch.autograd.grad(output, self.trainable, cotangent, retain_graph=retain_graph or not verified,
                                        allow_unused=True, materialize_grads=True)
            if len(self._per_row) == len(self.trainable):
                return [self._per_row[j].reshape(rows // samples, samples, *p.shape).sum(0)
                        for j, p in enumerate(self.trainable)]
            if samples == 1:
                return [g.unsqueeze(0) for g in grads]
            method = "per-sample"  # the graph could not be split: one backward per sample on the retained graph
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
        grads: list[torch.Tensor | None] = [None] * len(self.trainable)
        segments = self._rows // samples
        for (i, x, _), d in zip(records, d_outputs):
            _, w, b = self._layers[i]
            dtype = self.trainable[w if w is not None else b].dtype
            # (samples, segments x tokens, features): each sample's rows and tokens are summed over.
            d = d.to(dtype).reshape(segments, samples, -1, d.shape[-1]).transpose(0, 1).reshape(samples, -1, d.shape[-1])
            if w is not None:
                x = x.to(dtype).reshape(segments, samples, -1, x.shape[-1]).transpose(0, 1).reshape(samples, -1,
                                                                                                    x.shape[-1])
                g = torch.bmm(d.transpose(1, 2), x)
                grads[w] = g if grads[w] is None else grads[w] + g
            if b is not None:
                g = d.sum(dim=1)
                grads[b] = g if grads[b] is None else grads[b] + g
        return [torch.zeros(samples, *p.shape, dtype=p.dtype, device=p.device) if g is None else g
                for g, p in zip(grads, self.trainable)]
