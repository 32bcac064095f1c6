"""Validity: may the update reuse the rollout's backbone call?

The structural match already proves same parameters and same inputs (see :mod:`.backbone`). This pass checks
what a match cannot see: train/eval mode, autocast, and random ops (dropout) whose draws would differ between
the two calls. Mode and RNG differences refuse reuse; precision differences are numerics findings (reuse
reproduces the rollout's numerics), which ``strict=True`` refuses. The last condition, no optimizer step
between rollout and reuse, is a property of the schedule: the plan confines reuse to the micro-steps before
the first optimizer step, and the runtime checks parameter versions at every reuse.

Writes ``node.meta[FINDING]`` on the first node of a call a finding concerns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..plan import Finding
from .shared import backbone_calls
from .graph import op_packet
from .meta import CALL, FINDING

_RANDOM_OPS = {"native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", "randint", "normal",
               "uniform", "multinomial"}


def _op_name(node: fx.Node) -> str:
    """The op's name without overload or in-place suffix: ``bernoulli_.float`` -> ``bernoulli``."""
    return op_packet(node).rstrip("_")


@dataclass(frozen=True)
class Validity:
    findings: tuple[Finding, ...]

    @property
    def reusable(self) -> bool:
        return not any(f.refuses for f in self.findings)

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(f.message for f in self.findings if f.refuses)


def check_validity(rollout: fx.GraphModule, update: fx.GraphModule, pair: tuple[int, int], strict: bool = False,
                   numerics_only: bool = False) -> Validity:
    u_nodes, r_nodes = backbone_calls(update)[pair[0]], backbone_calls(rollout)[pair[1]]
    u_call, r_call = u_nodes[0].meta[CALL], r_nodes[0].meta[CALL]
    findings = []
    if u_call.training != r_call.training:
        findings.append(Finding("mode", f"the backbone is in {'train' if r_call.training else 'eval'} mode in the "
                                f"rollout but {'train' if u_call.training else 'eval'} mode in the update", True))
    random_ops = sorted({_op_name(n) for n in u_nodes + r_nodes if n.op == "call_function" and _op_name(n) in _RANDOM_OPS})
    if random_ops:
        findings.append(Finding("rng", f"the backbone draws random numbers ({', '.join(random_ops)}, e.g. dropout): "
                                "the update's draws would differ from the rollout's", True))
    if u_call.autocast != r_call.autocast:
        findings.append(Finding("numerics", f"autocast differs: rollout {r_call.autocast}, update {u_call.autocast}; "
                                "reuse keeps the rollout's numerics", strict))
    if numerics_only:
        findings.append(Finding("numerics", "the rollout and the update differ in numerics only (dtype casts of the "
                                "backbone's inputs, or cuDNN attention's training graph); reuse keeps the rollout's "
                                "numerics", strict))
    for f in findings:
        u_nodes[0].meta.setdefault(FINDING, []).append(f)
    return Validity(tuple(findings))
