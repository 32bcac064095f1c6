"""The backbone as its batch-1 AOTAutograd partition mapped over rows: any subset of a call's rows can be
backpropagated alone.

A kept call must serve update calls that hold any of its rows, in any order and grouping (shuffled micro-batches,
CFG as one doubled call or as two). The partition of the batched call cannot backpropagate a subset of its rows for
a subset's price, so the backbone is partitioned at one row (min-cut: the forward graph saves what the backward
graph reads) and both graphs are traced under ``torch.vmap`` over a leading row dimension into plain aten graphs
at the batch sizes that occur. Every saved tensor then has its row on dimension 0, by construction: rows are
independent because the program is the one-row program applied to each row, and the backward of rows ``R`` is
the one-row backward of each, run on ``saved[R]``, with each parameter's gradient summed over the rows (Retain) or
kept per row (Reweight's per-sample gradients, for every kind of parameter).

Graphs are compiled per row signature (shapes without the batch, dtypes, autocast, module state) and traced per
batch size; the batch-1 partition runs the pipeline ``ONE_ROW_PARTITION`` and the traced graphs ``TRACED_ROWS``
(:mod:`leancompile.passes.pipeline`), each pass recorded in the history the backbone was given.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..backbones.checkpointing import without_checkpointing
from ..backbones.plain import parameters_by_name
from ..passes import pipeline
from ..passes.eager_bits import EAGER_DECOMPOSITIONS, keeping_whole
from ..passes.graph import reading_data
from ..passes.meta import FACTORS
from ..passes.rowwise import random_operators
from . import program_cache
from .calls import Call, OutputLayout, output_layout
from .snapshot import restored_on_failure


_TRACES: OrderedDict = OrderedDict()  # (program digest, batch, ...) -> traced graph, across backbones
_TRACES_KEPT = 64


@dataclass
class RowProgram:
    """The batch-1 partition of one row signature."""

    forward: torch.fx.GraphModule | None  # (weights..., *call tensors) -> (output, *saved)
    backward: torch.fx.GraphModule | None  # (*saved, cotangent) -> gradients of the forward's inputs (None: no grad)
    trainable: tuple[int, ...]  # positions among the weights whose gradient the backward returns
    per_row: tuple[bool, ...]  # per saved tensor: computed from the row's data (else from the weights alone)
    output: OutputLayout | None  # the module's output around the one tensor the program returns
    digest: str  # of both graphs' code and constants: equal programs share their traced graphs
    refusal: str | None = None  # why such a call is never kept (a random operator, an output without rows)
    input_grads: tuple[int, ...] = ()  # positions among the call's tensors whose gradients follow the weights'
    # (weights...) -> the saved tensors computed from the weights alone: recomputed for each backward, so that a
    # kept call holds activations only (under FSDP2 a gathered weight's storage is freed after its block)
    weight_saved: torch.fx.GraphModule | None = None
    failed: bool = False  # the refusal is an error raised while compiling, not what the call returns


@dataclass(frozen=True)
class Factors:
    """A weight's per-row gradients kept as two factors: row ``r``'s is ``left[r] @ right[r]``, ``(m, k) @ (k, n)``
    (see :func:`leancompile.passes.rowwise.keep_products_as_factors`)."""

    left: torch.Tensor  # (rows, m, k)
    right: torch.Tensor  # (rows, k, n)


class NotRowLaid(ValueError):
    """The module's output has no one row-laid tensor: its calls are not kept, by design."""


class RowwiseBackbone:
    """A module's call run row by row (as one vmapped graph) with its saved tensors handed out."""

    def __init__(self, backbone, memory_budget: float = 1.0, tune_matmuls: bool = True,
                 history: pipeline.PassHistory | None = None, traced=None, live_weights: bool = False,
                 input_grads: bool = False, programs: dict | None = None):
        self.backbone = backbone
        self.traced = traced if traced is not None else backbone  # what functional_call runs (hook-free)
        self.memory_budget = memory_budget
        self.tune_matmuls = tune_matmuls
        self.history = history if history is not None else pipeline.PassHistory()
        # Read at each use where the module's parameters are swapped (FSDP2 registers its gathered weights in its
        # pre-forward and the shards after); otherwise looked up once: walking the modules costs milliseconds per step.
        self.live_weights = live_weights
        self.input_grads = input_grads  # compile the gradients of the floating row inputs too (a block's states)
        self._params = parameters_by_name(backbone)
        self._buffers = dict(backbone.named_buffers())
        # Where each parameter is read by name (live weights): FSDP1 registers its gathered views as parameters in a
        # unit's forward, but as plain attributes in its pre-backward (and always, with use_orig_params=False),
        # which named_parameters() does not list
        self._places = [(name, backbone.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                        for name in self._params]
        self._weight_values: tuple = ((), None)  # (key, versions, ids), the weight-only saved tensors
        # Shared by modules of one structure (identical transformer blocks compile once: the weights are inputs)
        self._programs: dict[tuple, RowProgram] = programs if programs is not None else {}
        self._forwards: dict[tuple, torch.fx.GraphModule] = {}
        self._backwards: dict[tuple, torch.fx.GraphModule] = {}
        self.compile_seconds = 0.0  # spent compiling and tracing its programs, in all
        self.forward_graph: torch.fx.GraphModule | None = None  # the last traced, for inspection
        self.backward_graph: torch.fx.GraphModule | None = None

    @property
    def weights(self) -> list[torch.Tensor]:
        self._refresh()
        return [*self._params.values(), *self._buffers.values()]

    def _refresh(self) -> None:
        if self.live_weights:
            self._params = {name: getattr(module, leaf) for name, module, leaf in self._places}
            self._buffers = dict(self.backbone.named_buffers())

    def program_of(self, key: tuple) -> RowProgram:
        """The compiled program of row signature ``key``."""
        return self._programs[key]

    def trainable(self, key: tuple) -> list[torch.Tensor]:
        """The parameters whose gradients the backward of program ``key`` returns, in its order."""
        weights = self.weights
        return [weights[i] for i in self._programs[key].trainable]

    # ------------------------------------------------------------------------------------------ compile

    def program(self, key: tuple, call: Call) -> RowProgram:
        """The batch-1 partition for the row signature ``key`` (compiled from the call's first row on first use)."""
        if key not in self._programs:
            start = time.perf_counter()
            try:
                with restored_on_failure(*self._modules()), self._compiling_timed(start):
                    self._programs[key] = self._partition(call)
            except Exception as error:  # what cannot be compiled at one row runs natively, and says why
                self._programs[key] = RowProgram(None, None, (), (), None, "",
                                                 f"one row does not compile ({type(error).__name__}: {error})",
                                                 failed=not isinstance(error, NotRowLaid))
        return self._programs[key]

    @contextlib.contextmanager
    def _compiling_timed(self, start: float):
        """Counts the time from ``start`` to the block's end (raising or not) as compile time."""
        try:
            yield
        finally:
            self.compile_seconds += time.perf_counter() - start

    def _modules(self) -> list[torch.nn.Module]:
        """The module and the copy it is traced through (one where it has none)."""
        return list({id(m): m for m in (self.backbone, self.traced)}.values())

    def _partition(self, call: Call, stored: bool = True) -> RowProgram:
        """The one-row partition of ``call``: read from the program cache where its joint graph was partitioned
        before (``stored``), else partitioned, its passes run, and written there."""
        # AOTAutograd imports torch._dynamo (most of a second): on the first compile, not with leancompile.
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        traced, graphs, outputs, names, recorded = self.traced, {}, [], [], len(self.history.records)

        def forward(params, buffers, *tensors):
            args, kwargs = call.with_tensors(tensors)
            rows = next((t for t, row in zip(tensors, call.tensor_rows) if row), None)
            with keeping_whole(rows):  # decomposed at the call's batch, as eager decomposes it (passes.eager_bits)
                result = torch.func.functional_call(traced, (params, buffers), args, kwargs)
            tensor, layout, refusal = output_layout(result)
            if refusal is not None:
                raise NotRowLaid(refusal)
            outputs.append(layout)
            return tensor

        def keep(name):
            def compiler(gm, _):
                graphs[name] = gm
                return make_boxed_func(gm)
            return compiler

        def partition(joint, joint_inputs, **kwargs):
            """The joint graph is the cache's key: what the module computes, as traced now."""
            names.append(program_cache.key("partition", _digest(joint), _placeholders(joint), sorted(kwargs.items()),
                                           self.memory_budget, self.tune_matmuls))
            entry = program_cache.load(names[-1]) if stored else None
            if entry is not None:
                raise _Stored(entry)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        compiled = aot_function(forward, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                partition_fn=partition)
        # Traced on fake copies: compiling computes nothing and touches no parameter's .grad.
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._refresh()
        params = {n: fake.from_tensor(p) for n, p in self._params.items()}
        buffers = {n: fake.from_tensor(b) for n, b in self._buffers.items()}
        data = [fake.from_tensor(t[:1].detach() if row else t.detach())
                for t, row in zip(call.tensors, call.tensor_rows)]
        inputs = tuple(i for i, (t, row) in enumerate(zip(data, call.tensor_rows))
                       if self.input_grads and row and t.is_floating_point())
        for i in inputs:
            data[i].requires_grad_()
        try:
            with fake, without_checkpointing(traced), _compiling(), torch.enable_grad(), \
                    functorch_config.patch(activation_memory_budget=self.memory_budget):
                out = compiled(params, buffers, *data)
                wrt = [p for p in params.values() if p.requires_grad] + [data[i] for i in inputs]
                torch.autograd.grad(out, wrt, torch.zeros_like(out), allow_unused=True)  # compiles the backward
        except _Stored as hit:
            program = _read_program(hit.entry, outputs[0])
            if program is None:  # it did not rebuild to the graphs it was stored as: compiled here instead
                return self._partition(call, stored=False)
            self.history.records.extend(hit.entry["history"])
            return program
        fw, bw = graphs["forward"], graphs["backward"]
        refusal = None
        if out.dim() == 0 or out.shape[0] != 1:
            refusal = f"the output ({tuple(out.shape)} at one row) has no row dimension"
        if random := random_operators(fw):
            refusal = f"random operator {random[0]} in the call: a rerun draws other numbers"
        for gm, name in ((fw, "one-row forward"), (bw, "one-row backward")):
            pipeline.run(pipeline.ONE_ROW_PARTITION, gm, name, self.history)
        results = next(iter(bw.graph.find_nodes(op="output"))).args[0]
        weights = len(self._params) + len(self._buffers)
        trainable = tuple(i for i, r in enumerate(results[:weights]) if r is not None)
        input_grads = tuple(i for i in inputs if results[weights + i] is not None)
        per_row = _reads_data(fw, weights)
        program = RowProgram(fw, bw, trainable, per_row, outputs[0], _digest(fw, bw), refusal, input_grads,
                             _weight_part(fw, weights, per_row))
        _store_program(names[0], program, self.history.records[recorded:])
        return program

    def _traced(self, cache: dict, key: tuple, fn, args, forward: bool = False) -> torch.fx.GraphModule:
        """``fn`` traced on ``args``; shared by every backbone whose program has the same digest (the weights are
        inputs: two trainers of one architecture trace once), and with later processes through the program
        cache."""
        if key not in cache:
            leaves = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            shared = (self._programs[key[0]].digest, key[1:], self.tune_matmuls,
                      tuple((tuple(t.shape), t.dtype, t.device) for t in leaves))
            if shared not in _TRACES:
                with self._compiling_timed(time.perf_counter()):
                    _TRACES[shared] = self._read_trace(shared, forward) or self._trace(shared, key, fn, args, forward)
                while len(_TRACES) > _TRACES_KEPT:
                    _TRACES.popitem(last=False)
            cache[key] = _TRACES[shared]
        return cache[key]

    def _read_trace(self, shared: tuple, forward: bool) -> torch.fx.GraphModule | None:
        entry = program_cache.load(program_cache.key("rows", shared, forward))
        if entry is None:
            return None
        self.history.records.extend(entry["history"])
        return program_cache.rebuild(entry["graph"])

    def _trace(self, shared: tuple, key: tuple, fn, args, forward: bool) -> torch.fx.GraphModule:
        """``fn`` traced on ``args`` and its pipeline run; a backward's ``key`` is ``(program, rows, per_row,
        factors)``."""
        # Kernels without a batching rule (the CPU attention kernels) trace as one call per row, which
        # fold_per_row_calls folds back into one. PyTorch warns about it; it is expected here.
        device = args[-1].device  # the last data input (forward) or the cotangent (backward)
        # A forward is traced without grad, as the rollout's calls it answers run: eager picks some kernels by
        # whether a tensor requires grad (a weight cast by autocast requires it only with grad).
        grad = torch.no_grad() if forward else contextlib.nullcontext()
        # once per shape, like the partition: whatever raises puts the module back (runtime.snapshot)
        with torch.autocast(device.type, enabled=False), _quiet_vmap_fallback(), grad, \
                restored_on_failure(*self._modules()):
            gm = make_fx(fn, EAGER_DECOMPOSITIONS, tracing_mode="fake")(*args)
        if not forward and key[3]:  # the weights' per-row gradients may come back as factors
            next(iter(gm.graph.find_nodes(op="output"))).meta[FACTORS] = len(self._programs[key[0]].trainable)
        recorded = len(self.history.records)
        name = (f"{'forward' if forward else 'backward'} over {key[1]} rows"
                + (", gradients per row" if not forward and key[2] else "")
                + (" or as factors" if not forward and key[3] else ""))
        pipeline.run(pipeline.TRACED_ROWS, gm, name, self.history, forward, self.tune_matmuls)
        _store(program_cache.key("rows", shared, forward),
               lambda: {"graph": program_cache.dump(gm), "history": self.history.records[recorded:]})
        return gm

    # -------------------------------------------------------------------------------------------- run

    def forward(self, key: tuple, call: Call) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The call's output tensor and its saved tensors (row on dimension 0), without autograd."""
        program = self.program(key, call)
        data = [t.detach().contiguous() for t in call.tensors]  # as traced: graphs are shared by shape, not strides
        rows_in = call.tensor_rows
        fw, out_dims = program.forward, (0, *(0 if r else None for r in program.per_row))

        def rows(weights, *data):
            if call.batch == 1:  # the one-row program as it is: a row dimension in front, no vmap
                return tuple(o if d is None else o.unsqueeze(0) for o, d in zip(fw(*weights, *data), out_dims))
            one = lambda *ts: tuple(fw(*weights, *[t.unsqueeze(0) if r else t for t, r in zip(ts, rows_in)]))
            return torch.vmap(one, in_dims=tuple(0 if r else None for r in rows_in), out_dims=out_dims)(*data)

        weights = self.weights
        # A kept call's weight-only values are recomputed from the weights its backward finds, which the engine
        # verifies unchanged since this call (versions, fingerprint); values cached before it may predate a write
        # through .data, which moves no version counter, or (FSDP2) a gather of updated shards.
        self._weight_values = ((), None)
        gm = self._traced(self._forwards, (key, call.batch), rows, (weights, *data), forward=True)
        self.forward_graph = gm
        with torch.no_grad(), torch.autocast(call.device.type, enabled=False):
            output, *saved = gm(weights, *data)
        return output.squeeze(1), [t for t, row in zip(saved, program.per_row) if row]

    def backward(self, key: tuple, saved: list[torch.Tensor], cotangent: torch.Tensor,
                 per_row: bool = False, factors: bool = False) -> list:
        """Gradients of the program's trainable parameters for the rows ``saved`` (the per-row saved tensors)
        holds, given the output's ``cotangent``: summed over the rows, or ``(rows, *shape)`` each when ``per_row``
        (with ``factors``, a linear layer's as :class:`Factors` where those are smaller); then, per row, those of
        the inputs at ``input_grads``."""
        program = self._programs[key]
        bw, in_dims = program.backward, (*(0 if r else None for r in program.per_row), 0)
        params = len(program.trainable)

        def rows(saved, cotangent):
            one = lambda *a: tuple(g for g in bw(*a[:-1], a[-1].unsqueeze(0)) if g is not None)
            if cotangent.shape[0] == 1:  # one row: its program as it is, no vmap
                grads = one(*(t if d is None else t.squeeze(0) for t, d in zip(saved, in_dims)), cotangent[0])
                # an input's gradient has its row dimension already (the program's, of 1)
                return [g.unsqueeze(0) if per_row and i < params else g for i, g in enumerate(grads)]
            grads = torch.vmap(one, in_dims=in_dims)(*saved, cotangent)
            # an input's gradient at one row keeps the program's row dimension of 1
            return [g.squeeze(1) if i >= params else g if per_row else g.sum(0) for i, g in enumerate(grads)]

        rows_saved = iter(saved)
        weight_saved = iter(self._weight_saved(key))
        saved = [next(rows_saved) if row else next(weight_saved) for row in program.per_row]
        gm = self._traced(self._backwards, (key, cotangent.shape[0], per_row, per_row and factors), rows,
                          (saved, cotangent))
        self.backward_graph = gm
        with torch.no_grad(), torch.autocast(cotangent.device.type, enabled=False):
            return [Factors(*g) if isinstance(g, tuple) else g for g in gm(saved, cotangent)]

    def _weight_saved(self, key: tuple) -> list[torch.Tensor]:
        """The saved tensors of program ``key`` computed from the weights alone, from the current weights (kept
        until the next kept call, while the weights are the same tensors at the same versions)."""
        weights = self.weights
        stamp = (key, tuple(w._version for w in weights), tuple(map(id, weights)))
        if self._weight_values[0] != stamp:
            program = self._programs[key]
            with torch.no_grad(), torch.autocast(weights[0].device.type, enabled=False):
                values = list(program.weight_saved(*weights)) if program.weight_saved is not None else []
            self._weight_values = (stamp, values)
        return self._weight_values[1]



@contextlib.contextmanager
def _quiet_vmap_fallback():
    """Without vmap's warning that a kernel has no batching rule and runs once per row (printed by C++ where no
    Python handler is active): expected while tracing, and ``fold_per_row_calls`` folds those calls back into one."""
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)


@contextlib.contextmanager
def _compiling():
    """Say that a graph is being traced, as torch.compile does: models then skip shortcuts that read their inputs'
    values to choose a kernel (transformers drops the attention mask when it has no padding), which a trace cannot
    follow and which would make one row's program depend on the values of the row it was traced on."""
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


def _reads_data(fw: torch.fx.GraphModule, weights: int) -> tuple[bool, ...]:
    """Per saved output of ``fw``: whether it depends on a data input (the placeholders after the weights)."""
    reads = reading_data(fw.graph, weights)
    saved = next(iter(fw.graph.find_nodes(op="output"))).args[0][1:]
    return tuple(n in reads for n in saved)


def _weight_part(fw: torch.fx.GraphModule, weights: int, per_row: tuple[bool, ...]) -> torch.fx.GraphModule | None:
    """``(weights...) -> the saved outputs of fw computed from the weights alone``, cut out of ``fw``."""
    saved = next(iter(fw.graph.find_nodes(op="output"))).args[0][1:]
    wanted = [n for n, row in zip(saved, per_row) if not row]
    if not wanted:
        return None
    needed, stack = set(), list(wanted)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, env = torch.fx.Graph(), {}
    for i, node in enumerate(fw.graph.find_nodes(op="placeholder")):
        if i < weights:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in fw.graph.nodes:
        if node in needed and node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in wanted))
    return torch.fx.GraphModule(fw, graph)


class _Stored(Exception):
    """Raised out of AOTAutograd where the joint graph's partition is in the program cache: the rest is read."""

    def __init__(self, entry: dict):
        self.entry = entry


def _placeholders(gm: torch.fx.GraphModule) -> tuple:
    """Each input's name, shape, stride, dtype, device and whether it requires grad (not in the graph's code)."""
    vals = [(n.name, n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    return tuple((name, tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
                 if isinstance(v, torch.Tensor) else (name, repr(v)) for name, v in vals)


def _store_program(name: str, program: RowProgram, history: list) -> None:
    _store(name, lambda: {"fields": {f: getattr(program, f) for f in _STORED_FIELDS},
                          "graphs": {g: program_cache.dump(getattr(program, g)) for g in _STORED_GRAPHS},
                          "history": history})


def _store(name: str, entry) -> None:
    """Write the entry ``entry()`` makes, unless its graphs cannot be stored by name (then it is compiled again
    in the next process)."""
    try:
        made = entry()
    except program_cache.Unstorable:
        return
    program_cache.store(name, made)


_STORED_GRAPHS = ("forward", "backward", "weight_saved")
_STORED_FIELDS = ("trainable", "per_row", "digest", "refusal", "input_grads")


def _read_program(entry: dict, output: OutputLayout) -> RowProgram | None:
    """The stored program with this trace's output layout, or None where its graphs do not rebuild to the digest
    they were stored with."""
    graphs = {g: program_cache.rebuild(entry["graphs"][g]) for g in _STORED_GRAPHS}
    program = RowProgram(output=output, **graphs, **entry["fields"])
    return program if _digest(program.forward, program.backward) == program.digest else None


def _digest(*graphs: torch.fx.GraphModule) -> str:
    """What a graph computes, weights aside: its code and the values of its constants."""
    h = hashlib.sha256()
    for gm in graphs:
        h.update(gm.code.encode())
        for node in gm.graph.find_nodes(op="get_attr"):
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                h.update(str((value.dtype, tuple(value.shape))).encode())
                h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
