"""Prompt conditioning passed to a backbone alongside the latents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning for one batch.

    ``text`` is ``(B, L, D)``; ``pooled`` is ``(B, P)`` or ``None`` for families without a pooled
    embedding (Wan).
    """

    text: torch.Tensor
    pooled: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.text.shape[0]

    def _map(self, fn) -> Conditioning:
        return Conditioning(fn(self.text), None if self.pooled is None else fn(self.pooled))

    def index(self, idx) -> Conditioning:
        """Select rows (an index tensor, list or slice) of every tensor."""
        return self._map(lambda t: t[idx])

    def repeat_interleave(self, n: int) -> Conditioning:
        """Repeat each row ``n`` times in place, e.g. one prompt per group of samples."""
        return self._map(lambda t: t.repeat_interleave(n, dim=0))

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        """Concatenate along the batch dimension."""
        parts = list(parts)
        if not parts:
            raise ValueError("parts: expected at least one Conditioning, got none")
        has_pooled = {p.pooled is not None for p in parts}
        if len(has_pooled) != 1:
            raise ValueError("parts: expected all or none to have a pooled embedding, got a mix")
        text = torch.cat([p.text for p in parts], dim=0)
        pooled = torch.cat([p.pooled for p in parts], dim=0) if has_pooled == {True} else None
        return Conditioning(text, pooled)

    def to(self, *args, **kwargs) -> Conditioning:
        """Like ``Tensor.to``, applied to every tensor."""
        return self._map(lambda t: t.to(*args, **kwargs))


# Registered as a pytree node so that a Conditioning can be passed straight through
# tracers that flatten their inputs (aot_autograd, make_fx, torch.compile).
pytree.register_pytree_node(
    Conditioning,
    lambda c: ([c.text, c.pooled], None),
    lambda children, _ctx: Conditioning(*children),
    serialized_type_name="leancompile.backbones.Conditioning",
    flatten_with_keys_fn=lambda c: ([(pytree.GetAttrKey("text"), c.text), (pytree.GetAttrKey("pooled"), c.pooled)],
                                    None),
)
