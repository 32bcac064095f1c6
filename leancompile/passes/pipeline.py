"""The pass pipeline: which passes run on which graph, in what order, and what each did.

Two kinds of pass share one history. The **analyses** read the traced rollout and update programs and return a
frozen result (``detect_shared_backbone``, ``check_validity``, ``check_linearity``, ``prune_gradient_need``,
``rewrite_for_retain``); :meth:`PassHistory.analyse` times each and records what it found. The **rewrites** take
one graph, change it in place and return how many nodes they changed; they run as the pipelines below, in order,
and :func:`run` ends each the same way: lint the graph, recompile it where it changed, give new nodes their
values where a later pass reads them, and record the pass. A pass that raises, or leaves a graph that does not
lint, fails with :class:`PassError` naming the pass and the graph.

==========================  ============================================================================
pipeline                    graphs
==========================  ============================================================================
``ONE_ROW_PARTITION``       the backbone's AOTAutograd partition at one row, forward and backward
``TRACED_ROWS``             those graphs ``vmap``-traced over a call's rows, at each batch size that occurs
==========================  ============================================================================
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .eager_bits import fuse_biases_into_products
from .identities import drop_copies_of_unshared_values, drop_multiplications_by_one, fold_views
from .inplace import write_scatters_in_place
from .matmul_order import order_matrix_products
from .rowwise import fold_per_row_calls, keep_products_as_factors, prepare_for_rows, sum_products_over_rows


@dataclass(frozen=True)
class Pass:
    """A rewrite of one graph: ``rewrite(gm)`` changes ``gm`` in place and returns how many nodes it changed."""

    rewrite: Callable[[fx.GraphModule], int]
    new_values: bool = False  # later passes read the values of the nodes it makes: propagate them after it
    forward_only: bool = False  # runs on forward graphs only
    # runs on backward graphs only: it changes a product's rounding, and a kept call's forward returns eager's bits
    backward_only: bool = False
    tuning: bool = False  # runs only where matrix products are tuned (``tune_matmuls``)

    @property
    def name(self) -> str:
        return self.rewrite.__name__

    def applies(self, forward: bool, tune_matmuls: bool) -> bool:
        return ((forward or not self.forward_only) and (not forward or not self.backward_only)
                and (tune_matmuls or not self.tuning))


ONE_ROW_PARTITION = (
    Pass(drop_multiplications_by_one),
    Pass(drop_copies_of_unshared_values),
    Pass(prepare_for_rows),
)
TRACED_ROWS = (
    Pass(keep_products_as_factors, backward_only=True),
    Pass(fuse_biases_into_products),
    Pass(fold_per_row_calls, new_values=True),
    Pass(sum_products_over_rows, new_values=True),
    Pass(write_scatters_in_place, forward_only=True),
    Pass(order_matrix_products, tuning=True, backward_only=True),
    Pass(fold_views),
)


@dataclass(frozen=True)
class PassRecord:
    """One pass run on one graph."""

    name: str
    graph: str
    changed: int  # nodes a rewrite changed (analyses: 0)
    nodes: tuple[int, int]  # the graph's nodes before and after (analyses: the programs' total)
    seconds: float
    found: str = ""  # what an analysis found


class PassError(RuntimeError):
    """A pass failed or left an invalid graph."""


class PassHistory:
    """Every pass run for one optimized trainer or wrapped module, in order."""

    def __init__(self):
        self.records: list[PassRecord] = []

    def analyse(self, name: str, on: str, fn: Callable, *args, found: Callable[[object], str] = lambda r: "",
                **kwargs):
        """Run the analysis ``fn(*args, **kwargs)`` of the programs ``on`` names, record it, and return its
        result."""
        graphs = [a for a in args if isinstance(a, fx.GraphModule)]
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as error:
            raise PassError(f"analysis {name} failed: {type(error).__name__}: {error}") from error
        total = sum(len(gm.graph.nodes) for gm in graphs)
        self.records.append(PassRecord(name, on, 0, (total, total),
                                       time.perf_counter() - start, found(result)))
        return result

    def table(self) -> str:
        """The history as text, one pass per line."""
        lines = [f"  {'pass':<32} {'graph':<28} {'changed':>7} {'nodes':>13} {'ms':>8}  found"]
        lines += [f"  {r.name:<32} {r.graph:<28} {r.changed:>7} {f'{r.nodes[0]}->{r.nodes[1]}':>13} "
                  f"{r.seconds * 1e3:>8.1f}  {r.found}" for r in self.records]
        return "\n".join(lines)


def run(passes: tuple[Pass, ...], gm: fx.GraphModule, graph: str, history: PassHistory | None = None,
        forward: bool = True, tune_matmuls: bool = True) -> fx.GraphModule:
    """Apply ``passes`` (those that apply to this graph) to ``gm`` in order, in place; returns ``gm``."""
    for p in passes:
        if p.applies(forward, tune_matmuls):
            apply(p, gm, graph, history)
    return gm


def apply(p: Pass | Callable, gm: fx.GraphModule, graph: str = "graph", history: PassHistory | None = None) -> int:
    """One pass on ``gm``: run it, check the graph, recompile it where it changed; returns the nodes it changed."""
    p = p if isinstance(p, Pass) else Pass(p)
    before, start = len(gm.graph.nodes), time.perf_counter()
    try:
        changed = p.rewrite(gm)
        if changed:
            gm.graph.lint()
            gm.recompile()
            if p.new_values:
                _propagate_values(gm)
    except Exception as error:
        raise PassError(f"pass {p.name} on {graph}: {type(error).__name__}: {error}") from error
    if history is not None:
        history.records.append(PassRecord(p.name, graph, changed, (before, len(gm.graph.nodes)),
                                          time.perf_counter() - start))
    return changed


def _propagate_values(gm: fx.GraphModule) -> None:
    """Give every node its fake value again (the placeholders keep the trace's)."""
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm, mode=placeholders[0].fake_mode).propagate_dont_convert_inputs(*placeholders)
