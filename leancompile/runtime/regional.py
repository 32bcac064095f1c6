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
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..backbones.plain import fsdp1_unit, fully_sharded, plain_copy, whole_shape, zero3_sharded
from ..passes.pipeline import PassHistory
from ..plan import VALUES, StepAction
from .calls import Call, bound, named_forward, output_layout
from .dtypes import through_casts
from .engine import HELD, ReuseEngine, StepLog, Verified, no_stats
from .identity import TRAINING_FLAGS, StateReader, row_keys
from .modes import ModeProof
from .policy import Directive, KeepPolicy, StepPolicy
from .reweight import LowestPrecision, coarsest
from .reweight_blocks import BlockProvisional, Heads
from .rowwise import RowwiseBackbone
from .schedule_runtime import ScheduleRuntime
from .store import Found, KeptCall, KeptCalls


_IDLE = Verified(None, "no backbone call is running", "arguments")


class RegionalEngine:
    """The backbone's calls run natively with each block's calls routed through the block's own engine."""

    def __init__(self, backbone: torch.nn.Module, blocks: list[torch.nn.Module],
                 block_runtime: Callable[[], ScheduleRuntime], tune_matmuls: bool = True,
                 history: PassHistory | None = None, shared: tuple[str, ...] = (),
                 call_shared: frozenset[str] = frozenset(), fractions: tuple[float, ...] = (1.0,),
                 policy: KeepPolicy | None = None, verify: str = VALUES,
                 checkpoints: list[torch.nn.Module | None] | None = None):
        """``block_runtime`` makes each block's schedule runtime; it must serve calls whose inputs require grad.
        ``shared``: the blocks' arguments that every row shares whatever their leading size (a family's
        ``block_shared``); ``call_shared``: the backbone's (see runtime.calls). ``fractions``: the activation
        memory budgets the plan keeps steps at (each block's partition at each). ``policy``: which backbone calls
        to keep (their blocks keep theirs). ``verify``: what an answer is checked against besides the state
        (plan.VERIFY). ``checkpoints``: per block, the checkpoint wrapper around the FSDP1 unit that holds it
        (activation checkpointing applied before FSDP1; None: none)."""
        self.backbone = backbone
        self.verify = verify
        self.call_shared = call_shared
        self.policy = policy if policy is not None else StepPolicy()
        self.blocks = list(blocks)
        self.engines = []
        self._block_policies = [StepPolicy() for _ in self.blocks]  # this engine says what each block keeps
        self.log = StepLog()  # one for every block's engine: their records in call order
        programs: dict[tuple, dict] = {}  # per block structure and budget: its compiled programs
        for block, policy in zip(self.blocks, self._block_policies):
            native = type(block).forward.__get__(block)  # the class's forward: the hooks run around the routing
            traced, kind = plain_copy(block), structure(block)
            rowwise = {f: RowwiseBackbone(block, f, tune_matmuls, history, traced=traced, live_weights=True,
                                          input_grads=True, programs=programs.setdefault((kind, f), {}))
                       for f in sorted({*fractions, 1.0})}
            self.engines.append(ReuseEngine(block, block_runtime(), rowwise, policy, native=native, log=self.log,
                                            shared=frozenset(shared), verified=self._verified, verify=verify))
        self._routes = [_ByName(engine, block) for block, engine in zip(self.blocks, self.engines)]
        self._checkpoints = [(wrapper, self._checkpointed_unless_verified(wrapper))
                             for wrapper in checkpoints or () if wrapper is not None]
        # The kept backbone calls (inputs and state; the blocks keep the rest, and digest their own weights)
        self.reader = StateReader(backbone, others=[t for engine in self.engines for t in engine.reader.versioned],
                                  verify=verify)
        self.store = KeptCalls(self.reader)
        self._modes = ModeProof(backbone, self.reader)
        self._precision: torch.dtype | None = None  # the coarsest the heads' cotangents were computed in
        self._current: Verified = _IDLE  # the backbone call running now, as its blocks' calls see it
        # Reweight, while provisional heads run: which head is backpropagated, and each verified call's output by
        # its rows and constants (a second head's call is the first's: the blocks' weights are not gathered again)
        self._heads: Heads | None = None
        self._outputs: dict[tuple, object] = {}
        # Reweight: a call without grad that matches no kept call (a KL reference with the adapters off) runs once
        # during the heads and its values are kept; the other heads' and the update's equal calls are served them
        self._values = ReuseEngine(backbone, self.engines[0].schedule_runtime, {}, shared=call_shared,
                                   native=self._natively, log=self.log, verify=verify)
        self._idle: frozenset[int] = frozenset()  # blocks the heads run without grad (see provisional)
        self._answered: list[torch.nn.Module] = []  # blocks the heads answer with kept outputs (see provisional)
        # by FSDP2, FSDP1 (whose units wrap the blocks) or ZeRO-3
        self._sharded = (any(map(fully_sharded, self.blocks)) or any(map(fsdp1_unit, backbone.modules()))
                         or zero3_sharded(backbone))
        self.schedule_runtime = self.engines[0].schedule_runtime
        if not self.schedule_runtime.input_gradients:
            raise ValueError(f"{self.schedule_runtime.name} cannot serve a block: its served calls do not return their "
                             "inputs' gradients")
        self.rowwise = self.engines[0].rowwise  # the first block's programs, for inspection

    answering_with_leaves_now = False  # while Reweight's provisional loss heads run (see provisional)

    def __call__(self, *args, **kwargs):
        directive, action = self.policy.directive(), None
        if directive.unchecked:
            self._current = Verified(None)
        else:
            call = Call.of(args, kwargs, self.call_shared)
            if torch.is_grad_enabled() and not self.answering_with_leaves_now:
                self.policy.closed(self)
            self._current, action = self._verify(call, directive)
            coefficients = self._current.context
            if coefficients is not None and self._heads is not None:
                memo = (coefficients.key, repr(call.spec), tuple(l for l in call.leaves if not torch.is_tensor(l)))
                if memo in self._outputs:
                    self._current = _IDLE
                    return self._outputs[memo][0]
            # Under FSDP2 only within the heads: a call served its values runs none of FSDP2's gathers, and
            # whether an update's call matches may differ between ranks
            if (self._current.rows is None and call.refusal is None and not torch.is_grad_enabled()
                    and (self._heads is not None or (self._values.kept and not self._sharded))):
                self._current = _IDLE
                return self._values(*args, **kwargs)
        coefficients = self._current.context
        # A verified call under the heads: its answered blocks' weights are not gathered for a forward that reads
        # none (their one-row backward gathers them, see BlockProvisional)
        answered = self._answered if coefficients is not None and self._heads is not None else []
        try:
            with self._routed(), _without_forward_gathers(answered), self._blocks_doing(directive, action):
                output = self.backbone(*args, **kwargs)
        finally:
            self._current = _IDLE
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

    def _verified(self, call: Call) -> Verified:
        """A block call's identity: the rows of the backbone call it runs in, where that call is verified (else
        why not)."""
        current = self._current
        if current.rows is not None and call.batch != current.rows[0].shape[0]:
            return Verified(None, "the block's call holds other rows than the backbone call's", "inputs")
        return current

    def _verify(self, call: Call, directive: Directive) -> tuple[Verified, StepAction | None]:
        """The backbone call's rows when a kept call has them all (bitwise) in the same state, or the call is kept
        as such while the blocks keep (with the action they keep it under); else why not. Under Reweight, a
        verified call with grad carries where its coefficients will be found (the schedule's block context)."""
        if call.refusal is not None:
            return Verified(None, f"not reusable: {call.refusal}", "arguments"), None
        state = self.reader.read(call)
        if self.store.drop_stale(state):  # made with other weights: never matched again
            self._free_blocks()
        if directive.keep is not None:
            return self._keep(call, state, directive.made), directive.keep
        found, rows = self._lookup(call, state), call.row_inputs
        if found.match is None and found.kind == "inputs":
            # arguments in another dtype than the kept call's, read only through a cast to it (see .dtypes): the
            # kept call's rows identify the blocks' calls
            cast = through_casts(call, self.store, lambda c: (self._modes.traced(self.reader.read(c), c), None),
                                 lambda c: self._lookup(c, self.reader.read(c)), self.call_shared)
            if cast is not None:
                found, rows = cast[0], (cast[1] or call).row_inputs
        if found.match is not None:
            if not torch.is_grad_enabled():
                return Verified(rows), None
            context, refusal = self.schedule_runtime.block_context(found, self._precision)
            if refusal is not None:
                return Verified(None, refusal, "inputs"), None
            return Verified(rows, context=context), None
        action = None if torch.is_grad_enabled() else self.policy.unmatched(call, self)
        if action is None:
            return Verified(None, found.reason, found.kind), None
        return self._keep(call, state), action

    def _lookup(self, call: Call, state) -> Found:
        """The kept backbone call's rows that have ``call``'s rows in its ``state``, or why none."""
        return self.store.lookup(call, row_keys(call.row_inputs), self._modes_agree, state=state)

    def _modes_agree(self, kept: KeptCall, state, call: Call) -> str | None:
        """Why the module computes differently in the call's training modes than in the kept call's (None: the
        same; each block's engine then compares its own programs too, see ReuseEngine._modes_agree). The mode
        proof traces the module as it is now under both flags: it shows nothing of attributes or hooks that
        differ, so those recompute."""
        if kept.state.difference(state) != TRAINING_FLAGS:
            return kept.state.explain(state, self.reader)
        return self._modes(kept.state, state, call)

    def _keep(self, call: Call, state, made: list | None = None) -> Verified:
        """Keep the call's inputs and state (its blocks keep the rest)."""
        kept = self.store.add(state, call)
        if made is not None:
            made.append(kept)
        return Verified(call.row_inputs)

    def _free_blocks(self) -> None:
        """Free what the blocks and the values engine keep: the backbone calls they were kept for are gone."""
        self._precision = None
        self._values.release()
        for engine in self.engines:
            engine.release()

    def provisional(self, heads: list) -> None:
        """Reweight per block: run each loss head on the module as the update will, every block's call answered
        with its kept output (:class:`~leancompile.runtime.reweight_blocks.BlockProvisional`), and backpropagate it
        through the module's own graph, so that each block's cotangent comes from the module around it and FSDP2
        gathers the block's weights for its one-row backward as it does for native's (and reduce-scatters nothing:
        no parameter receives a gradient). Every kept call not backpropagated yet is."""
        if not self.schedule_runtime.advantages:
            raise ValueError("provisional loss heads need schedule='reweight'; the blocks run "
                             f"{self.schedule_runtime.name}")
        heads_ = Heads(len(heads))
        # FSDP2: a block whose forward hooks the heads skip (see __call__) is gathered for its one-row backward
        recorders = [BlockProvisional(engine, engine.kept, heads_, gathers=_hooks_of(block) is not None)
                     for block, engine in zip(self.blocks, self.engines)]
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

    def release(self, why: str | None = None) -> None:
        """Free every kept call now (``why``: what a later call that finds none is told)."""
        self.store.release(why)
        self._free_blocks()

    @contextlib.contextmanager
    def _routed(self):
        for i, (block, route) in enumerate(zip(self.blocks, self._routes)):
            # an idle block is not the engine's: nothing of it is kept or looked up
            block.forward = torch.no_grad()(self.engines[i].native) if i in self._idle else route
        for wrapper, forward in self._checkpoints:
            wrapper.forward = forward
        try:
            yield
        finally:
            for module in (*self.blocks, *(wrapper for wrapper, _ in self._checkpoints)):
                del module.forward

    def _checkpointed_unless_verified(self, wrapper: torch.nn.Module) -> Callable:
        """The forward of a checkpoint wrapper around a block's FSDP1 unit while the blocks are routed: a verified
        or kept backbone call's block runs without the wrapper's checkpointing (the block's engine keeps what its
        backward reads, and a recompute would run the block natively again), any other call's checkpointed as
        natively."""
        checkpointed = type(wrapper).forward.__get__(wrapper)
        unit = wrapper._checkpoint_wrapped_module

        def forward(*args, **kwargs):
            return (checkpointed if self._current.rows is None else unit)(*args, **kwargs)

        return forward

    @contextlib.contextmanager
    def _blocks_doing(self, directive: Directive, action: StepAction | None):
        """The blocks keep their calls made inside under ``action`` where the backbone call is kept, as the
        schedule places it (``retain@f``: every block's partition at activation memory budget f, recomputing the
        rest of its forward in its backward; ``reweight@f``: the last blocks, holding the fraction f of the blocks'
        trainable parameters, whole, the first natively); they run unchecked where the caller said so."""
        with contextlib.ExitStack() as stack:
            if action is not None:
                sizes = [sum(p.numel() for p in block.parameters() if p.requires_grad) for block in self.blocks]
                kept, each = self.schedule_runtime.blocks_kept(action, sizes)
                for i, policy in enumerate(self._block_policies):
                    stack.enter_context(policy.keeping(each) if i in kept else policy.passing())
            elif directive.unchecked:
                for policy in self._block_policies:
                    stack.enter_context(policy.passing())
            yield

    @property
    def check_seconds(self) -> float:
        """The blocks' engines' check time since their statistics were last taken."""
        return sum(engine.check_seconds for engine in self.engines)

    @property
    def compiled_seconds(self) -> float:
        """Seconds the blocks' programs spent compiling and tracing, in all."""
        return sum(engine.compiled_seconds for engine in self.engines)

    def take_stats(self) -> dict:
        """Since the last time: calls (block calls) served and recomputed and why; the bytes held, each block's
        peak summed; the check time."""
        stats = self.log.stats()  # the blocks' engines share the log: read before they clear it
        return self._summed(stats, [engine.take_stats() for engine in self.engines])

    def end_step(self) -> dict:
        """The step's statistics (:meth:`take_stats`); everything kept is freed."""
        stats = self.log.stats()
        stats = self._summed(stats, [engine.end_step() for engine in self.engines])
        self.release()
        return stats

    def _summed(self, stats: dict, blocks: list[dict]) -> dict:
        stats = {**no_stats(), **stats}
        for name in (*HELD, "check_seconds", "compile_seconds"):
            stats[name] = sum(s[name] for s in blocks)
        self.log.records.clear()
        return stats


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
    parts += [(n, tuple(whole_shape(p)), p.dtype, p.requires_grad) for n, p in module.named_parameters()]
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

    def __init__(self, engine: ReuseEngine, block: torch.nn.Module):
        self.engine = engine
        # The forward that names the block's arguments (a checkpoint_wrapper's block binds as the block it wraps),
        # read before any route is set on the block
        self.forward = named_forward(block)
        self.learned = False

    def __call__(self, *args, **kwargs):
        args, named = bound(self.forward, args, kwargs)
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
