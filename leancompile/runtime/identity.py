"""What decides a backbone call's result, read when the call happens: its inputs row by row, and its state.

Two calls give the same rows of output when each row's inputs are bitwise equal (every tensor the module
receives: latents, sigma, text and pooled conditioning), the non-tensor arguments are equal, and the call's
state is the same: every parameter and buffer unmodified (version counters, frozen ones included), every
submodule's training flag, each LoRA layer's adapters enabled or not, which parameters require grad, and the
autocast state of the call's device. A weight fingerprint, checked once per update phase, also catches writes
through ``.data`` (which bump no version counter). Random operators are refused where the call is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backbones import Conditioning


def call_inputs(x, sigma, cond: Conditioning) -> tuple[torch.Tensor, ...]:
    """The tensors a backbone call receives, each with its rows on dimension 0."""
    return tuple(t for t in (x, sigma, cond.text, cond.pooled) if t is not None)


@dataclass(frozen=True)
class CallState:
    """A call's state besides its inputs' values; two calls may share rows only when their states are equal."""

    signature: tuple  # per input: shape without its rows, dtype, device
    autocast: tuple  # (enabled, dtype) on the call's device type
    modules: tuple  # training flag of every submodule, adapters disabled per LoRA layer, requires_grad per parameter
    versions: tuple  # version counter of every parameter and buffer

    def difference(self, other: "CallState") -> str | None:
        """The first kind in which ``other`` differs (None when equal): the reason a call recomputes."""
        for kind, field in (("inputs", "signature"), ("autocast", "autocast"), ("module state", "modules"),
                            ("weights", "versions")):
            if getattr(self, field) != getattr(other, field):
                return kind
        return None

    @property
    def compile_key(self) -> tuple:
        """What a compiled program depends on (not the weights' values)."""
        return self.signature, self.autocast, self.modules


class StateReader:
    """Reads :class:`CallState` for one backbone (its module and tensor lists taken once)."""

    def __init__(self, backbone: torch.nn.Module, sources: list[torch.Tensor] = ()):
        self.modules = list(backbone.modules())
        self.lora = [m for m in self.modules if hasattr(m, "lora_A")]
        self.parameters = list(backbone.parameters())
        self.tensors = [*self.parameters, *backbone.buffers()]
        self.sources = list(sources)  # what the weights are copies of (FSDP2 shards): versioned too

    def read(self, inputs: tuple[torch.Tensor, ...]) -> CallState:
        device = inputs[0].device.type
        signature = tuple((tuple(t.shape[1:]), t.dtype, t.device) for t in inputs)
        autocast = (torch.is_autocast_enabled(device),
                    torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        modules = (tuple(m.training for m in self.modules), tuple(bool(m.disable_adapters) for m in self.lora),
                   tuple(p.requires_grad for p in self.parameters))
        return CallState(signature, autocast, modules, tuple(t._version for t in (*self.tensors, *self.sources)))

    def fingerprint(self) -> torch.Tensor:
        """One float64 number per weight that changes when any element does (a position-weighted sum)."""
        sums = []
        for t in self.tensors:
            flat = t.detach().reshape(-1).double()
            weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).mul_(0.6180339887).sin_()
            sums.append(torch.dot(flat, weights))
        return torch.stack(sums) if sums else torch.zeros(0, device="cpu")


def row_keys(inputs: tuple[torch.Tensor, ...]) -> list[tuple]:
    """A hashable digest of each row's inputs: a weighted sum of the row's bytes in integers, exact whatever the
    batch it sits in (a float reduction would round differently in a batch of 4 than alone). Equal rows give equal
    digests; a match is then checked bitwise."""
    columns = []
    for t in inputs:
        flat = t.detach().reshape(t.shape[0], -1)
        # A fresh row-major copy: a broadcast sigma (stride 0) cannot be viewed as bytes.
        data = flat.new_empty(flat.shape).copy_(flat).view(torch.uint8).to(torch.int64)
        weights = torch.arange(data.shape[1], device=data.device, dtype=torch.int64).mul_(2654435761).remainder_(
            2**31).add_(1)
        columns.append(data @ weights if data.device.type != "cpu" else (data * weights).sum(1))
    return [tuple(row) for row in torch.stack(columns, dim=1).tolist()]
