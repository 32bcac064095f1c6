"""Reuse per transformer block: each block's calls go through their own reuse engine, verified and served as a
whole backbone call is, while the module around the blocks runs eagerly as the trainer calls it.

Under FSDP2, ``fully_shard`` puts its hooks on each block: the pre-forward gathers the block's weights and the
post-forward frees them again; the pre-backward gathers them for the backward and the post-backward
reduce-scatters the block's gradients (or accumulates them unsharded while gradient sync is off). A partition of
the whole module cannot keep those hooks: AOTAutograd traces through them only on a gathered copy of every weight.
Here only each block's own ``forward`` is replaced (an instance attribute, set for the duration of a backbone
call), so FSDP2's hooks run around it exactly as natively:

* a kept rollout call runs each block's one-row program (:mod:`.rowwise`) on the weights FSDP2 has just gathered
  and keeps the block's per-row activations, never its weights (what the backward needs of the weights alone is
  recomputed from the weights gathered for it);
* an update call runs the embeddings and output layers natively, with grad (a small part of the FLOPs). The
  backbone call is verified as a whole call is (every row's inputs bitwise equal to a kept call's rows, the same
  state of every weight, flag and adapter, the same autocast); then each block's call is served from the kept
  block call of those rows where the block's own state is the same too. The blocks' inputs are not compared
  bitwise: the embeddings recompute them at the update's batch, and kernels that choose their reduction by batch
  size (a matrix-vector product at one row) round them differently from the rollout's; they are the same
  function of the same verified inputs and weights, so the block serves what Retain serves, exact in real
  arithmetic. A backbone call that is not verified runs every block natively, and the statistics say why.
  Training flags may differ (a rollout in ``eval()``, an update in ``train()``) where both modes compute the same:
  the module's forward traced in each mode on fake weights is one graph (see ``RegionalEngine._modes_differ``),
  and each block's engine finds the block's one-row programs in both modes equal before it serves.
  A served block's backward runs after FSDP2's pre-backward gathered its weights:
  the block's one-row backward on the kept rows, returning the gradients of its parameters and of its inputs
  (the previous block's output), which FSDP2's post-backward reduce-scatters as it does native's.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..backbones.plain import fully_sharded, plain_copy, with_fake_weights
from ..passes.pipeline import PassHistory
from .calls import Call, bound, output_layout
from .engine import KeptCall, Match, ReuseEngine, ScheduleRuntime, StepLog
from .identity import TRAINING_FLAGS, CallState, StateReader, row_keys
from .reweight import LowestPrecision, Reweight, coarsest
from .reweight_blocks import BlockProvisional, Coefficients, Heads
from .rowwise import RowwiseBackbone, _compiling


_IDLE = (None, "no backbone call is running", "arguments")


class RegionalEngine:
    """The backbone's calls run natively with each block's calls routed through the block's own engine."""

    def __init__(self, backbone: torch.nn.Module, blocks: list[torch.nn.Module],
                 schedule: Callable[[], ScheduleRuntime], tune_matmuls: bool = True, history: PassHistory | None = None,
                 shared: tuple[str, ...] = (), call_shared: frozenset[str] = frozenset(),
                 fractions: tuple[float, ...] = (1.0,)):
        """``schedule`` makes each block's schedule; it must serve calls whose inputs require grad (Retain).
        ``shared``: the blocks' arguments that every row shares whatever their leading size (a family's
        ``block_shared``); ``call_shared``: the backbone's (see runtime.calls). ``fractions``: the activation
        memory budgets the plan keeps steps at (each block's partition at each)."""
        self.backbone = backbone
        self.call_shared = call_shared
        # For a wrapped module: the action to keep a call without grad that matches nothing under (None: not kept),
        # asked of each such call (see leancompile.wrap); a trainer says what to keep with ``keeping``.
        self.admit = None
        self.blocks = list(blocks)
        self.engines = []
        programs: dict[tuple, dict] = {}  # per block structure and budget: its compiled programs
        for block in self.blocks:
            native = type(block).forward.__get__(block)  # the class's forward: the hooks run around the routing
            traced, kind = plain_copy(block), structure(block)
            rowwise = {f: RowwiseBackbone(block, f, tune_matmuls, history, traced=traced, live_weights=True,
                                          input_grads=True, programs=programs.setdefault((kind, f), {}))
                       for f in sorted({*fractions, 1.0})}
            self.engines.append(ReuseEngine(block, schedule(), rowwise, native=native, shared=frozenset(shared)))
        for engine in self.engines:
            engine.identity = self._identity
        self._routes = [_ByName(engine, type(block).forward) for block, engine in zip(self.blocks, self.engines)]
        self.reader = StateReader(backbone)
        self._calls: list[KeptCall] = []  # the kept backbone calls (inputs and state; the blocks keep the rest)
        self._stale: str | None = None  # why the kept calls were last freed, where the weights changed
        self._precision: torch.dtype | None = None  # the coarsest the heads' cotangents were computed in
        self._index: dict[tuple, list[tuple[KeptCall, int]]] = {}
        self._current: tuple = _IDLE
        self._keeping = self._passing = False
        self._fingerprint, self._checked = None, True  # of every weight when the first call was kept
        # Reweight, while provisional heads run: which head is backpropagated, and each verified call's output by
        # its rows and constants (a second head's call is the first's: the blocks' weights are not gathered again)
        self._heads: Heads | None = None
        self._outputs: dict[tuple, object] = {}
        # Reweight: a call without grad that matches no kept call (a KL reference with the adapters off) runs once
        # during the heads and its values are kept; the other heads' and the update's equal calls are served them
        self._values = ReuseEngine(backbone, self.engines[0].schedule, {}, shared=call_shared, native=self._natively)
        self._idle: frozenset[int] = frozenset()  # blocks the heads run without grad (see provisional)
        self._answered: list[torch.nn.Module] = []  # blocks the heads answer with kept outputs (see provisional)
        self._sharded = any(fully_sharded(block) for block in self.blocks)  # by FSDP2
        # (kept call's compile key, call's compile key) -> why the two training modes compute differently (None:
        # they compute the same), and each mode's traced forward by compile key (see _modes_differ)
        self._modes: dict[tuple, str | None] = {}
        self._mode_graphs: dict[tuple, torch.fx.GraphModule] = {}
        self._share_log()
        self.schedule = self.engines[0].schedule
        if not self.schedule.input_gradients:
            raise ValueError(f"{self.schedule.name} cannot serve a block: its served calls do not return their "
                             "inputs' gradients")
        self.rowwise = self.engines[0].rowwise  # the first block's programs, for inspection

    answering_with_leaves_now = False  # while Reweight's provisional loss heads run (see provisional)

    def __call__(self, *args, **kwargs):
        coefficients = None
        if self._passing:
            self._current, action = (None, "", ""), None
        else:
            call = Call.of(args, kwargs, self.call_shared)
            self._current, action, coefficients = self._verify(call)
            if coefficients is not None and self._heads is not None:
                memo = (coefficients.key, repr(call.spec), tuple(l for l in call.leaves if not torch.is_tensor(l)))
                if memo in self._outputs:
                    self._current = _IDLE
                    return self._outputs[memo][0]
            # Under FSDP2 only within the heads: a call served its values runs none of FSDP2's gathers, and
            # whether an update's call matches may differ between ranks
            if (self._current[0] is None and call.refusal is None and not torch.is_grad_enabled()
                    and (self._heads is not None or (self._values.kept and not self._sharded))):
                self._current = _IDLE
                return self._values(*args, **kwargs)
        for engine in self.engines:
            engine.context = coefficients
        # A verified call under the heads: its answered blocks' weights are not gathered for a forward that reads
        # none (their one-row backward gathers them, see BlockProvisional)
        answered = self._answered if coefficients is not None and self._heads is not None else []
        try:
            with self._routed(), _without_forward_gathers(answered), \
                    self.keeping(action) if action is not None else contextlib.nullcontext():
                output = self.backbone(*args, **kwargs)
        finally:
            self._current = _IDLE
            for engine in self.engines:
                engine.context = None
        if coefficients is None:
            return output
        # Reweight: the output's backward records a head's cotangent, or finds the served call's coefficients
        tensor, layout, refusal = output_layout(output)
        if refusal is not None:
            return output  # no coefficients: the blocks recompute in the backward
        output = coefficients.at_output(tensor, self._heads)
        if self._heads is not None:
            self._outputs[memo] = (layout.unpack(output), output)
            return self._outputs[memo][0]
        return layout.unpack(output)

    def _natively(self, *args, **kwargs):
        """The backbone's call with every block run natively (they see no verified call)."""
        with self._routed():
            return self.backbone(*args, **kwargs)

    def _identity(self, call: Call) -> tuple[tuple[torch.Tensor, ...] | None, str, str]:
        """A block call's identity: the rows of the backbone call it runs in, where that call is verified (else
        None, why not and the reason's kind)."""
        rows, reason, kind = self._current
        if rows is not None and call.batch != rows[0].shape[0]:
            return None, "the block's call holds other rows than the backbone call's", "inputs"
        return rows, reason, kind

    def _verify(self, call: Call) -> tuple[tuple, object, Coefficients | None]:
        """``(rows, why not, kind)``: the backbone call's rows when a kept call has them all (bitwise) in the same
        state, or the call is kept as such while the blocks keep; else None and why. With it, the action a wrapped
        module's admission keeps a call that matches nothing under (None: not kept here), and under Reweight,
        for a verified call with grad, where its coefficients will be found."""
        if call.refusal is not None:
            return (None, f"not reusable: {call.refusal}", "arguments"), None, None
        state = self.reader.read(call)
        if self._calls and self._calls[0].state.versions != state.versions:
            stale = self._calls[0].state.explain(state, self.reader)
            self._forget()  # made with other weights: never matched again
            self._stale = stale
        if self._keeping:
            return self._remember(call, state), None, None
        matched, places = self._match(call, state)
        if matched[0] is not None and torch.is_grad_enabled() and isinstance(self.schedule, Reweight):
            if any(len(candidates) > 1 for candidates in places):
                # Which of two equal kept rows a block serves is its own engine's choice: its provisional gradient
                # must be the one these coefficients are found for, so equal kept rows are not told apart.
                return (None, "Reweight per block: a row equals several kept rows", "inputs"), None, None
            return matched, None, Coefficients(Match(tuple(candidates[0] for candidates in places)), self._precision)
        if matched[0] is not None or self.admit is None or torch.is_grad_enabled():
            return matched, None, None
        action = self.admit(call)
        return (matched, None, None) if action is None else (self._remember(call, state), action, None)

    def _remember(self, call: Call, state) -> tuple:
        """Keep the call's inputs and state (its blocks keep the rest)."""
        self._stale = None
        if self._fingerprint is None:
            self._fingerprint = self.reader.fingerprint()
        self._checked = False  # the next update phase checks the fingerprint again
        kept = KeptCall(state, tuple(t.detach() for t in call.row_inputs),
                        tuple(t.detach() for t in call.whole_inputs), None, None)
        self._calls.append(kept)
        for row, digest in enumerate(row_keys(call.row_inputs)):
            self._index.setdefault(digest, []).append((kept, row))
        return call.row_inputs, "", ""

    def _match(self, call: Call, state) -> tuple[tuple, list]:
        """The call's rows when a kept call has them all (bitwise) in ``state``; else None and why. With them, per
        row, the kept rows in that state with its inputs."""
        if not self._calls:
            if self._stale is not None:  # freed because the weights changed: that is the reason
                return (None, f"the kept calls were freed: {self._stale}", "weights"), []
            return (None, "nothing kept", "nothing kept"), []
        places = []
        for i, digest in enumerate(row_keys(call.row_inputs)):
            found = [(kept, row) for kept, row in self._index.get(digest, ())
                     if all(torch.equal(mine[i], theirs[row]) for mine, theirs in zip(call.row_inputs, kept.inputs))
                     and all(torch.equal(mine, theirs) for mine, theirs in zip(call.whole_inputs, kept.whole))]
            if not found:
                return (None, f"the backbone call's row {i}: no kept call has these inputs", "inputs"), []
            differences, why = [], None
            for kept, _ in found:
                difference = kept.state.difference(state)
                if difference == TRAINING_FLAGS:  # a rollout in eval(), an update in train(): the same where both
                    why = self._modes_differ(kept.state, state, call)  # modes compute the same
                    difference = None if why is None else difference
                differences.append(difference)
            if None not in differences:
                return (None, why if differences[0] == TRAINING_FLAGS else
                        f"the backbone call differs from the kept call with these inputs in {differences[0]}",
                        differences[0]), []
            places.append([place for place, difference in zip(found, differences) if difference is None])
        if not self._checked and not self.answering_with_leaves_now:  # once per update phase: writes through .data
            # move no version counter
            self._checked = True
            if not torch.equal(self.reader.fingerprint(), self._fingerprint):
                self._forget()
                return (None, "a weight was written in place (through .data) since it was kept", "weights"), []
        return (call.row_inputs, "", ""), places

    def _modes_differ(self, kept: CallState, state: CallState, call: Call) -> str | None:
        """Why the module computes differently under ``state``'s training flags than under the kept call's (None:
        it computes the same): its forward traced in each mode, the blocks included, on fake weights (nothing is
        gathered), and the two graphs compared. A submodule that reads its flag where it changes the result
        (dropout with p > 0 draws random numbers in train mode, batch norm uses the batch's statistics) gives two
        graphs; one that reads it to no effect (dropout with p = 0) gives one. Each block's engine then compares
        its own one-row programs in both modes before it serves (see ReuseEngine._same_program)."""
        pair = (kept.compile_key, state.compile_key)
        if pair not in self._modes:
            try:
                theirs, mine = (self._traced_in(s, call) for s in (kept, state))
            except Exception as error:  # what does not trace cannot be shown to compute the same
                self._modes[pair] = (f"the module's forward does not trace in both training modes "
                                     f"({type(error).__name__}: {error}), so it cannot be shown to compute the same")
            else:
                self._modes[pair] = None if mine.code == theirs.code else _where_modes_differ(
                    theirs, mine, kept.explain(state, self.reader))
        return self._modes[pair]

    def _traced_in(self, state: CallState, call: Call) -> torch.fx.GraphModule:
        """The module's forward on one row of ``call`` with every submodule's training flag as in ``state`` (read
        in ``named_modules()`` order, as StateReader reads them), traced on a hook-free copy with fake weights;
        each node's meta names the submodule it ran in (``custom["module"]``)."""
        import torch.fx.traceback as fx_traceback  # tracing machinery, loaded when a mode is first compared
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        key = state.compile_key
        if key in self._mode_graphs:
            return self._mode_graphs[key]
        plain = with_fake_weights(self.backbone, call.device)
        named = list(plain.named_modules())
        if len(named) != len(state.training):
            raise ValueError("the module's tree changed since its flags were read")
        inside: list[str] = []

        def enter(name):
            def hook(*_):
                inside.append(name)
                fx_traceback.current_meta["custom"] = {"module": name}
            return hook

        def leave(*_):
            inside.pop()
            if inside:
                fx_traceback.current_meta["custom"] = {"module": inside[-1]}
            else:
                fx_traceback.current_meta.pop("custom", None)

        for (name, module), flag in zip(named, state.training):
            module.training = flag  # the copy's own flag: the module's stays
            module.register_forward_pre_hook(enter(name))
            module.register_forward_hook(leave)
        weights = dict(plain.named_parameters())
        mode = next((p.fake_mode for p in weights.values()), None) or FakeTensorMode(allow_non_fake_inputs=True)
        # Fake copies of the buffers too: batch norm in train mode writes its running statistics
        buffers = {n: mode.from_tensor(b) for n, b in plain.named_buffers()}
        data = [mode.from_tensor(t[:1].detach() if row else t.detach())
                for t, row in zip(call.tensors, call.tensor_rows)]

        def forward(weights, buffers, *tensors):
            args, kwargs = call.with_tensors(tensors)
            output = torch.func.functional_call(plain, (weights, buffers), args, kwargs)
            return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]

        enabled, dtype = state.autocast
        with mode, torch.no_grad(), _compiling(), fx_traceback.preserve_node_meta(), \
                torch.autocast(call.device.type, dtype=dtype, enabled=enabled):
            self._mode_graphs[key] = make_fx(forward)(weights, buffers, *data)
        return self._mode_graphs[key]

    def _forget(self) -> None:
        """Drop every kept call: made with other weights, they can never be matched again."""
        self._calls, self._index, self._precision = [], {}, None
        self._values.release()
        self._fingerprint, self._checked = None, True
        for engine in self.engines:
            engine.release()

    def provisional(self, heads: list, calls: list[list[KeptCall]] | None = None) -> None:
        """Reweight per block: run each loss head on the module as the update will, every block's call answered
        with its kept output (:class:`~leancompile.runtime.reweight_blocks.BlockProvisional`), and backpropagate it
        through the module's own graph, so that each block's cotangent comes from the module around it and FSDP2
        gathers the block's weights for its one-row backward as it does for native's (and reduce-scatters nothing:
        no parameter receives a gradient). ``calls``: per block, the calls to backpropagate (default: every kept
        call not backpropagated yet)."""
        if not isinstance(self.schedule, Reweight):
            raise ValueError(f"provisional needs the reweight schedule; the blocks run {self.schedule.name}")
        heads_ = Heads(len(heads))
        recorders = [BlockProvisional(engine, engine.kept if calls is None else calls[i], heads_)
                     for i, engine in enumerate(self.engines)]
        pending = [kept for recorder in recorders for kept in recorder.pending.values()]
        if not pending:
            return
        token = torch.zeros((), dtype=pending[0].output.dtype, device=pending[0].output.device, requires_grad=True)
        # The blocks before the first that backpropagates (Reweight of the last blocks only) need no cotangent: the
        # heads run them without grad
        self._idle = frozenset(range(next(i for i, recorder in enumerate(recorders) if recorder.pending)))
        self.answering_with_leaves_now, self._heads = True, heads_
        try:
            # the values engine keeps the heads' calls without grad that match nothing kept (see __init__)
            # FSDP2: a verified call's answered blocks read no weight in the heads' forward (see __call__)
            self._answered = [block for block, recorder in zip(self.blocks, recorders) if recorder.pending]
            for recorder in recorders:
                recorder.gathers = _hooks_of(recorder.engine.backbone) is not None
            with torch.enable_grad(), self._values.answering_with_leaves():
                losses = []
                for head in heads:
                    with contextlib.ExitStack() as stack:
                        for engine, recorder in zip(self.engines, recorders):
                            stack.enter_context(engine.answering_with_leaves(recorder.answer(token)))
                        losses.append(head())
                outputs = [output for _, output in self._outputs.values()]
                for heads_.current, loss in enumerate(losses):
                    # The output's cotangent first: a head without this term (the advantage-free head of a loss
                    # with none) is zero there, and backpropagates nothing into the blocks
                    with LowestPrecision() as seen:  # a float32 head over a float64 module rounds as float32
                        cotangents = torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True,
                                                         materialize_grads=True) if loss.requires_grad and outputs \
                            else ()
                    self._precision = coarsest(self._precision, seen.dtype)
                    if self._every_rank(any(bool(c.any()) for c in cotangents), token.device):
                        if not outputs:
                            raise RuntimeError(
                                "Reweight per block under FSDP2: another rank's loss head backpropagates through "
                                "the blocks and this rank's has no verified call to backpropagate, so FSDP2's "
                                "per-block collectives would differ between ranks; keep the same calls on every "
                                "rank (the same memory_limit and trained steps) or use schedule='retain'")
                        torch.autograd.grad(outputs, token, cotangents, retain_graph=True, allow_unused=True)
        finally:
            self.answering_with_leaves_now, self._heads, self._outputs, self._idle = False, None, {}, frozenset()
            self._answered = []
        for recorder in recorders:
            recorder.settle()

    def _every_rank(self, flag: bool, device: torch.device) -> bool:
        """``flag`` on any rank, where the blocks are sharded by FSDP2: a head's backward through them runs FSDP2's
        per-block all-gathers, which every rank must run alike (a head zero on one rank only runs everywhere)."""
        if not (self._sharded and dist.is_initialized()):
            return flag
        value = torch.tensor([float(flag)], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    @property
    def held_bytes(self) -> int:
        return sum(engine.held_bytes for engine in self.engines)

    def release(self) -> None:
        """Free every kept call now."""
        self._forget()

    @contextlib.contextmanager
    def _routed(self):
        for i, (block, route) in enumerate(zip(self.blocks, self._routes)):
            # an idle block is not the engine's: nothing of it is kept or looked up
            block.forward = torch.no_grad()(self.engines[i].native) if i in self._idle else route
        try:
            yield
        finally:
            for block in self.blocks:
                del block.forward

    @contextlib.contextmanager
    def keeping(self, action):
        """The blocks keep their calls made inside under ``action``; yields the kept block calls, per block.
        ``retain@f``: every block's partition at activation memory budget f, recomputing the rest of its forward in
        its backward. ``reweight@f``: the last blocks, holding the fraction f of the blocks' trainable parameters,
        keep their calls for per-sample gradients; the first run natively, and recompute in the update."""
        fraction = getattr(action, "fraction", 1.0)
        kept = range(len(self.engines))
        if isinstance(self.schedule, Reweight) and fraction < 1:
            kept, action = self.last_blocks(fraction), replace(action, fraction=1.0)
        made = []
        with contextlib.ExitStack() as stack:
            for i, engine in enumerate(self.engines):
                if i in kept:
                    made.append(stack.enter_context(engine.keeping(action)))
                else:
                    stack.enter_context(engine.passing())
                    made.append([])
            self._keeping = True
            try:
                yield made
            finally:
                self._keeping = False

    def last_blocks(self, fraction: float) -> range:
        """The last blocks holding at most ``fraction`` of the blocks' trainable parameters (at least one):
        Reweight keeps those nearest the output, so that the heads' backward stops at the first of them and their
        forward runs the blocks before it without grad."""
        sizes = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in self.blocks]
        budget, first, held = fraction * sum(sizes), len(sizes) - 1, sizes[-1]
        while first > 0 and held + sizes[first - 1] <= budget:
            first -= 1
            held += sizes[first]
        return range(first, len(sizes))

    @contextlib.contextmanager
    def passing(self):
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.passing())
            self._passing = True
            try:
                yield
            finally:
                self._passing = False

    def _share_log(self) -> None:
        """One log for every block's engine: their records in call order."""
        self.log = StepLog()
        for engine in (*self.engines, self._values):
            engine.log = self.log

    def take_stats(self) -> dict:
        """Since the last time: calls (block calls) served and recomputed and why; the bytes held, each block's
        peak summed; the check time."""
        return self._summed([engine.take_stats() for engine in self.engines])

    def end_step(self) -> dict:
        """The step's statistics (:meth:`take_stats`); everything kept is freed."""
        stats = self._summed([engine.end_step() for engine in self.engines])
        self._forget()
        return stats

    def _summed(self, blocks: list[dict]) -> dict:
        stats = self.log.stats()
        for name in (self.schedule.held, "check_seconds"):
            stats[name] = sum(s[name] for s in blocks)
        self._share_log()
        return stats


def _where_modes_differ(kept: torch.fx.GraphModule, now: torch.fx.GraphModule, fallback: str) -> str:
    """The submodule where the call's graph first departs from the kept call's, and the operator it runs there
    (``fallback``: where neither graph says)."""
    node_of = lambda n: (n.op, n.target, str(n.args), str(n.kwargs))  # noqa: E731
    for theirs, mine in itertools.zip_longest(kept.graph.nodes, now.graph.nodes):
        if theirs is None or mine is None or node_of(theirs) != node_of(mine):
            for node in (mine, theirs):
                module = node.meta.get("custom", {}).get("module") if node is not None else None
                if module is not None:
                    return (f"submodule {module or '(the module)'} computes differently in the call's training mode "
                            f"than in the kept call's: it runs {node.target} in one and not the other")
            break
    return fallback


def _hooks_of(block: torch.nn.Module) -> tuple | None:
    """FSDP2's forward hooks' handles on a block sharded by itself (None: none)."""
    state = block._get_fsdp_state() if fully_sharded(block) else None
    handles = (getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None))
    return None if None in handles else handles


@contextlib.contextmanager
def _without_forward_gathers(blocks: list[torch.nn.Module]):
    """FSDP2's forward hooks of ``blocks`` set aside for the duration: their pre-forward would gather the weights
    and their post-forward register the pre-backward gather, which the blocks' recorders do themselves."""
    taken = []
    for block in blocks:
        handles = _hooks_of(block)
        if handles is None:
            continue
        for hooks, handle in zip((block._forward_pre_hooks, block._forward_hooks), handles):
            taken.append((hooks, dict(hooks)))
            del hooks[handle.id]
    try:
        yield
    finally:
        for hooks, before in taken:
            hooks.clear()
            hooks.update(before)


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of ``module``'s outermost stacks of identical blocks: every ``nn.ModuleList`` whose modules are
    all of one class, outside any other such list (diffusers' ``transformer_blocks``, ``single_transformer_blocks``
    and ``blocks``; a causal LM's ``layers``). Lists of mixed modules (an attention's output projection and its
    dropout) are not blocks."""
    stacks: list[str] = []
    blocks = []
    for name, child in module.named_modules():
        if (isinstance(child, torch.nn.ModuleList) and len(child) and len({type(m) for m in child}) == 1
                and not any(name.startswith(f"{outer}.") for outer in stacks)):
            stacks.append(name)
            blocks += list(child)
    return blocks


def structure(module: torch.nn.Module) -> tuple:
    """What decides a module's compiled program besides its call: every submodule's class and settings (scalar
    attributes and dicts of scalars by value, other objects such as attention processors by class) and every
    parameter's and buffer's name, shape and dtype (and whether it requires grad). Blocks with equal structures
    run one program, each on its own weights."""
    parts = []
    for name, module_ in module.named_modules():
        settings = []
        for key, value in sorted(vars(module_).items()):
            if key == "training" or key == "forward" or key.startswith("_"):
                continue
            if isinstance(value, (bool, int, float, str, type(None), tuple)):
                settings.append((key, value))
            elif isinstance(value, dict) and all(isinstance(v, (bool, int, float, str)) for v in value.values()):
                settings.append((key, tuple(sorted(value.items()))))  # peft's per-adapter rank and scaling
            elif not isinstance(value, (torch.Tensor, torch.nn.Module)):
                settings.append((key, type(value)))
        parts.append((name, type(module_), tuple(settings)))
    parts += [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()]
    parts += [(n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()]
    return tuple(parts)


class _ByName:
    """Calls a block's engine with every argument by name: a model passes its blocks' arguments by name in one
    place and positionally in another (diffusers, under gradient checkpointing), and a call's tree is part of what
    must match.

    Names also say which tensors every row shares. A block receives tensors that are not per row but whose
    leading size may equal the batch (Wan's rotary embedding, ``(1, 1, tokens, dim)``, in a call of one row): the
    family names them (``Family.block_shared``), and for a module it does not know the first call of more than one
    row shows which arguments those are, shared from then on (a call of one row kept before that is classified
    otherwise, and so is never matched: it recomputes)."""

    def __init__(self, engine: ReuseEngine, forward):
        self.engine = engine
        self.forward = forward  # the block class's, unbound
        self.learned = False

    def __call__(self, *args, **kwargs):
        args, named = bound(self.forward, args, kwargs, skip_first=True)
        if not self.learned:
            self._learn_shared(named)
        return self.engine(*args, **named)

    def _learn_shared(self, named: dict) -> None:
        tensors = [(name, leaf) for name, value in named.items() for leaf in pytree.tree_leaves(value)
                   if isinstance(leaf, torch.Tensor) and leaf.dim()]
        batch = tensors[0][1].shape[0] if tensors else 1
        if batch > 1:
            self.engine.shared |= frozenset(name for name, t in tensors if t.shape[0] != batch)
            self.learned = True
