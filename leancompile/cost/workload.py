"""What a backbone call asks of a device: FLOPs and bytes moved per operator, counted on fake tensors.

FLOPs come from ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses); bytes moved are the
operator's inputs read and outputs written. A roofline turns each operator into time on a device:
``max(flops / peak, bytes / bandwidth) + launch``, summed over the call.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# The CPU's flash-attention kernels take the arguments of the CUDA ones, in the same order.
_FLOPS = {**flop_registry,
          aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
          aten._scaled_dot_product_flash_attention_for_cpu_backward:
              flop_registry[aten._scaled_dot_product_flash_attention_backward]}


@dataclass(frozen=True)
class Workload:
    """A multiset of operators, each a ``(flops, bytes moved)`` pair: what a program asks of a device. Blocks of
    a transformer repeat the same operators, so workloads add, subtract and multiply as multisets."""

    ops: Counter = field(default_factory=Counter)

    @property
    def total_flops(self) -> int:
        return sum(f * n for (f, _), n in self.ops.items())

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def seconds(self, peak_flops: float, bandwidth: float, launch: float, rows: float = 1.0) -> float:
        """Roofline time of the program over ``rows`` times the profiled batch: every operator is bound by compute
        or by memory traffic, plus its fixed launch cost (which does not grow with the batch)."""
        if not self.ops:
            return 0.0
        pairs = np.array(list(self.ops), dtype=np.float64)
        counts = np.array(list(self.ops.values()), dtype=np.float64)
        work = np.maximum(pairs[:, 0] * rows / peak_flops, pairs[:, 1] * rows / bandwidth)
        return float((counts * work).sum() + launch * counts.sum())

    def __add__(self, other: "Workload") -> "Workload":
        return Workload(self.ops + other.ops)

    def __sub__(self, other: "Workload") -> "Workload":
        return Workload(self.ops - other.ops)

    def __mul__(self, times: int) -> "Workload":
        return Workload(Counter({op: n * times for op, n in self.ops.items()}))


def operator_flops(func, args, kwargs, out) -> int:
    """FLOPs of one operator call by torch's formulas (0 for the operators they do not count: elementwise, views)."""
    count = _FLOPS.get(func._overloadpacket)
    return int(count(*args, **kwargs, out_val=out)) if count is not None else 0


def _nbytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))


class WorkloadCounter(TorchDispatchMode):
    """Records each operator's FLOPs and bytes moved. Views move no data and are not recorded."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in (aten.detach.default, aten.lift_fresh.default):
            return out
        self.ops[(operator_flops(func, args, kwargs, out), _nbytes((args, kwargs)) + _nbytes(out))] += 1
        return out

    def workload(self) -> Workload:
        return Workload(Counter(self.ops))


class FlopCounter(TorchDispatchMode):
    """The FLOPs of the operators computed inside it. A compiler tracing inside it (AOTAutograd on a program's first
    call) runs operators on functional, fake or meta tensors: those compute nothing and are not counted, so a
    compiling step counts only what it computes."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(_traced(t) for t in tree_flatten((args, kwargs))[0]):
            self.total += operator_flops(func, args, kwargs, out)
        return out


def _traced(value) -> bool:
    return isinstance(value, (FunctionalTensor, FakeTensor)) or (isinstance(value, torch.Tensor) and value.is_meta)
