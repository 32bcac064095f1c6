"""What decides a backbone call's result, read when the call happens: its inputs row by row, and its state.

Two calls give the same rows of output when each row's inputs are bitwise equal (every tensor the module
receives: latents, sigma, text and pooled conditioning, ids, masks; :mod:`.calls`), the tensors every row shares
are bitwise equal, the non-tensor arguments are equal, and the call's
state is the same: every parameter and buffer unmodified (version counters, frozen ones included), every
submodule's training flag, each LoRA layer's adapters enabled or not, which parameters require grad, each weight's
dtype, every submodule's plain attributes (numbers, strings, and lists or dicts of them: a norm's epsilon, a LoRA
layer's active adapter, scaling and merged adapters), the forward and backward hooks registered on each submodule
and globally, and the autocast state of the call's device. A digest of every weight's values
(:mod:`.digest`), taken per kept call and compared per answer, also catches writes that move no version counter
(through ``.data``, ``set_``, another alias). Random operators are refused where the call is compiled.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from ..backbones.plain import framework_hook, fsdp1_shard, fsdp1_unit, named_weights, zero3_partitioned
from ..plan import VALUES
from .calls import Call, argument_paths
from .digest import Unreadable, digest


TRAINING_FLAGS = "training flags"
MODULE_STATE = "module state"
_TRAINING = operator.itemgetter("training")
_ADAPTERS_OFF = operator.attrgetter("disable_adapters")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")

# Values of a submodule's attributes compared as state: plain ones, and lists, tuples and dicts of plain ones (read
# as tuples, since the module may change them in place: peft's ``scaling[adapter] = s``, ``merged_adapters.append``)
_PLAIN = (bool, int, float, str, type(None))
# torch's own per-module attributes: the training flag (compared apart), the tensors, submodules and hooks (their
# dictionaries), moved by what is compared elsewhere (a backward hook's registration); and the gradient
# checkpointing flag of transformers and diffusers models, which changes how a backward gets the forward's saved
# tensors (recomputed from the same inputs and weights), not what a call computes: TRL's and the diffusion scripts'
# rollouts run with it off and their updates with it on; DeepSpeed ZeRO-3's counters of a module's pending
# backward hooks (its ``ds_*`` ids and registries are not plain values)
_NOT_ATTRIBUTES = frozenset({*torch.nn.Module().__dict__, "gradient_checkpointing", "ds_grads_remaining",
                             "applied_pre_backward_ref_cnt"})
# The hook dictionaries of a module, and torch's global ones (every module's), with what each is called in a reason
_HOOKS = (("_forward_hooks", "forward hook"), ("_forward_pre_hooks", "forward pre-hook"),
          ("_backward_hooks", "backward hook"), ("_backward_pre_hooks", "backward pre-hook"))
_GLOBAL_HOOKS = tuple((getattr(torch.nn.modules.module, f"_global{attr}"), what) for attr, what in _HOOKS)
# LoRA layers' attributes, as a reason names them
_LORA_ATTRIBUTES = {"scaling": "adapter scaling", "_active_adapter": "active adapter",
                    "merged_adapters": "merged adapters"}


# The kinds in which two call states can differ, each with the CallState field it compares, in the order checked.
DIFFERENCES = (("inputs", "signature"), ("autocast", "autocast"), (MODULE_STATE, "modules"),
               ("weights", "versions"), (TRAINING_FLAGS, "training"))


@dataclass(frozen=True)
class CallState:
    """A call's state besides its inputs' values; two calls may share rows only when their states are equal."""

    signature: tuple  # the call's tree, constants, and per tensor its shape (without the rows), dtype and device
    autocast: tuple  # (enabled, dtype) on the call's device type
    # adapters disabled per LoRA layer, requires_grad per parameter, the submodules' plain attributes, the hooks
    # registered (``(module or None for global, kind, hook ids)`` per non-empty dictionary), each weight's dtype
    modules: tuple
    versions: tuple  # version counter of every parameter and buffer
    training: tuple = ()  # the training flag of every submodule

    def difference(self, other: "CallState") -> str | None:
        """The first kind in which ``other`` differs (None when equal): the reason a call recomputes. Training
        flags come last: calls that differ only there compute the same thing where both flags' programs are the
        same graph (no dropout, nothing else that reads them), which the engine checks."""
        for kind, field in DIFFERENCES:
            if getattr(self, field) != getattr(other, field):
                return kind
        return None

    def program_shows(self, other: "CallState") -> bool:
        """Whether the two states differ only where the call's one-row program shows it: training flags, plain
        attributes and hooks (a hook that makes the embeddings' output require grad, a gradient checkpointing flag
        a forward reads, dropout's p), each traced into the program compiled under the state. Two programs that are
        one graph compute the same; adapters, requires_grad, dtypes and weights must be equal besides."""
        if (self.signature, self.autocast, self.versions) != (other.signature, other.autocast, other.versions):
            return False
        (off, grads, _, _, dtypes), (off_now, grads_now, _, _, dtypes_now) = self.modules, other.modules
        return (off, grads, dtypes) == (off_now, grads_now, dtypes_now)

    def explain(self, other: "CallState", reader: "StateReader") -> str:
        """What differs between the two states, named: the argument, the parameters, the submodule."""
        kind = self.difference(other)
        if kind == "inputs":
            return f"argument {first_difference(self.signature, other.signature)}"
        if kind == "autocast":
            return f"autocast {other.autocast} differs from the kept call's {self.autocast}"
        if kind == MODULE_STATE:
            return _explain_modules(self.modules, other.modules, reader)
        if kind == "weights":
            changed = sum(a != b for a, b in zip(self.versions, other.versions))
            name = _first(reader.tensor_names, self.versions, other.versions)
            return (f"{changed} of {len(self.versions)} parameters and buffers were written since the kept call "
                    f"(their version counters moved: an optimizer step, load_state_dict, an in-place write), {name} "
                    "first: a call after it recomputes")
        if kind == TRAINING_FLAGS:
            changed = [i for i, (a, b) in enumerate(zip(self.training, other.training)) if a != b]
            # A submodule that reads its flag where it changes the result, where one can be found
            i = next((i for i in changed if _reads_its_flag(reader.modules[i])), changed[0])
            module = reader.modules[i]
            return (f"submodule {reader.module_names[i] or '(the module)'} ({type(module).__name__}) is in "
                    f"{'train' if other.training[i] else 'eval'} mode, the kept call ran it in "
                    f"{'train' if self.training[i] else 'eval'} mode, and the two modes' programs differ")
        return "equal"

    @property
    def compile_key(self) -> tuple:
        """What a compiled program depends on (not the weights' values)."""
        return self.signature, self.autocast, self.modules, self.training


class StateReader:
    """Reads :class:`CallState` for one backbone (its module and tensor lists taken once)."""

    def __init__(self, backbone: torch.nn.Module, sources: list[torch.Tensor] = (), others: tuple = (),
                 verify: str = VALUES):
        """``sources``: what the weights are copies of, where they are (FSDP2's shards); ``others``: tensors whose
        values other readers digest (a module's blocks, each digested by its own engine); ``verify``: ``VERSIONS``
        digests nothing."""
        named = list(backbone.named_modules())
        self.module_names, self.modules = [n for n, _ in named], [m for _, m in named]
        # Each module's flag read from its instance dict: an attribute lookup walks the class's whole MRO whenever
        # the interpreter's type cache has been evicted (it is, by a backbone call), several times the cost.
        self.flags = [m.__dict__ for m in self.modules]
        self.lora = [m for m in self.modules if hasattr(m, "lora_A")]
        parameters, buffers = named_weights(backbone), list(backbone.named_buffers())
        self.parameter_names = [n for n, _ in parameters]
        self.parameters = [p for _, p in parameters]
        self.tensors = [*self.parameters, *(b for _, b in buffers)]
        shards = (f"shard {i}" for i in range(len(sources)))
        self.tensor_names = [*self.parameter_names, *(n for n, _ in buffers), *shards]
        # What the weights are copies of (FSDP2 shards) is versioned and digested too.
        self.versioned = [*self.tensors, *sources]
        skip = {id(t) for t in others}
        self.partitioned = any(map(zero3_partitioned, self.versioned))  # by ZeRO-3 (see writes)
        # An FSDP1 flat parameter's version moves at each optimizer step, its values are read from its shard
        self.digested = [(name, fsdp1_shard(t)) for name, t in zip(self.tensor_names, self.versioned)
                         if id(t) not in skip and verify == VALUES]
        # The attributes compared: (instance dict, name) of each plain one, and of each container of plain ones
        # A LoRA layer's lists and dicts: its active adapter, scaling and merged adapters (its others, such as each
        # adapter's rank, change only where an adapter is added, which registers modules)
        # An FSDP1 unit's attributes are FSDP1's bookkeeping (whether it is the root, set at its first forward), not
        # the computation's: that is the module it wraps, whose attributes are compared
        lora, units = {id(m) for m in self.lora}, {i for i, m in enumerate(self.modules) if fsdp1_unit(m)}
        attributes = {kind: [(i, k) for i, d in enumerate(self.flags) for k, v in d.items()
                             if k not in _NOT_ATTRIBUTES and i not in units and _attribute(v) == kind
                             and (kind is tuple or id(self.modules[i]) not in lora or k in _LORA_ATTRIBUTES)]
                      for kind in (tuple, list, dict)}
        self.attribute_names = [(self.module_names[i], k) for kind in attributes for i, k in attributes[kind]]
        self._attributes = {kind: ([self.flags[i] for i, _ in at], [k for _, k in at])
                            for kind, at in attributes.items()}
        # Each hook dictionary, with its module's position (None: torch's global ones) and kind; which of them hold
        # hooks is looked up again whenever a hook was registered anywhere (torch numbers every hook handle from one
        # counter), and those are read at each call (a hook removed from one of them).
        self._hook_dicts = [*((i, what, m.__dict__[attr]) for i, m in enumerate(self.modules) for attr, what in _HOOKS),
                            *((None, what, d) for d, what in _GLOBAL_HOOKS)]
        self._hook_count: int | None = None
        self._hooked: list = []

    def read(self, call: Call) -> CallState:
        device = call.device.type
        signature = call.signature()
        autocast = (torch.is_autocast_enabled(device),
                    torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        modules = (tuple(map(_ADAPTERS_OFF, self.lora)), tuple(map(_REQUIRES_GRAD, self.parameters)),
                   self.attributes(), self.hooks(), tuple(map(_DTYPE, self.tensors)))
        return CallState(signature, autocast, modules, self.versions(), tuple(map(_TRAINING, self.flags)))

    def attributes(self) -> tuple:
        """The submodules' plain attributes (with the tuples of plain values), then their lists and dicts of plain
        values as tuples (the module may change them in place; a compile key is hashed), in ``attribute_names``
        order."""
        read = self._attributes
        try:
            return (*map(dict.get, *read[tuple]), *map(tuple, map(dict.get, *read[list])),
                    *map(tuple, map(dict.items, map(dict.get, *read[dict]))))
        except TypeError:  # an attribute that held a list or dict holds something else now
            return (*map(dict.get, *read[tuple]), *(_frozen(d.get(k)) for kind in (list, dict)
                                                   for d, k in zip(*read[kind])))

    def hooks(self) -> tuple:
        """``(module position or None, kind, hook ids)`` for each hook dictionary that holds hooks."""
        count = RemovableHandle.next_id
        if count != self._hook_count:
            self._hook_count = count
            self._hooked = [entry for entry in self._hook_dicts if entry[2]]
        held = ((i, what, tuple(k for k, hook in hooks.items() if not framework_hook(hook)))
                for i, what, hooks in self._hooked)
        return tuple(entry for entry in held if entry[2])

    def versions(self) -> tuple[int, ...]:
        """The version counters of every parameter and buffer (and what they are copies of)."""
        return tuple(map(_VERSION, self.versioned))

    def writes(self) -> tuple:
        """What shows that the weights were written between two reads: their version counters and, where a
        framework writes them without moving one (DeepSpeed ZeRO-3's optimizer writes the partitions through
        ``.data``), the digest of every weight's values (None where a storage holds none)."""
        if not self.partitioned:
            return self.versions()
        values = _readable_digest([fsdp1_shard(t) for t in self.versioned])
        return self.versions(), None if values is None else tuple(values.tolist())

    def digest(self) -> torch.Tensor | None:
        """The digest of every weight's values (one int64 per tensor); None where a tensor's storage holds no
        values (freed by a framework), so that nothing is answered by comparing it."""
        return _readable_digest([t for _, t in self.digested])

    def written(self, kept: torch.Tensor | None, now: torch.Tensor | None) -> str | None:
        """Why weights whose digest is ``now`` are not the ones a call kept with ``kept`` was made with (None: they
        are the same values)."""
        if kept is None or now is None:
            return ("a weight's storage held no values when the call was kept or now (a framework freed it), so the "
                    "weights could not be compared")
        if torch.equal(kept, now):
            return None
        changed = (kept != now).nonzero().flatten().tolist()
        return (f"{len(changed)} of {len(self.digested)} parameters and buffers hold other values than when the call "
                f"was kept, {self.digested[changed[0]][0]} first, and no version counter moved: they were written "
                "through .data, set_ or another alias (a reference or EMA swap; DeepSpeed ZeRO-3's optimizer step "
                "writes its partitions so)")


def _readable_digest(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``digest(tensors)``, None where a tensor's storage holds no values."""
    try:
        return digest(tensors)
    except Unreadable:
        return None


def _attribute(value) -> type | None:
    """How an attribute's value is compared: as it is (``tuple``: a plain value, or a tuple of them), as a copy
    (``list``, ``dict``: of plain values, which the module may change in place), or not (None)."""
    kind = type(value)
    if kind in _PLAIN:
        return tuple
    if kind is dict:
        return dict if all(type(v) in _PLAIN for v in (*value, *value.values())) else None
    return kind if kind in (list, tuple) and all(type(v) in _PLAIN for v in value) else None


def _frozen(value):
    """A value as it is now, hashable (a list or dict as a tuple: the module may change it in place)."""
    return tuple(value.items()) if type(value) is dict else tuple(value) if type(value) is list else value


def _explain_modules(kept: tuple, now: tuple, reader: "StateReader") -> str:
    """What differs in the module state (CallState.modules), named."""
    (off, grads, attributes, hooks, dtypes), (off_now, grads_now, attributes_now, hooks_now, dtypes_now) = kept, now
    if off != off_now:
        return "a LoRA layer's adapters are enabled or disabled unlike in the kept call"
    if attributes != attributes_now:
        i = next(i for i, (a, b) in enumerate(zip(attributes, attributes_now)) if a != b)
        module, name = reader.attribute_names[i]
        if name in _LORA_ATTRIBUTES:
            what = _LORA_ATTRIBUTES[name]
            return f"{what} of {module} ({attributes_now[i]!r}) differs from the kept call's ({attributes[i]!r})"
        return (f"attribute {name} of {module or '(the module)'} is {attributes_now[i]!r}, in the kept call "
                f"{attributes[i]!r}")
    if hooks != hooks_now:
        before, after = set(hooks), set(hooks_now)
        i, what, _ = next(iter(sorted(after - before, key=repr) or sorted(before - after, key=repr)))
        where = "every module (a global hook)" if i is None else (reader.module_names[i] or "the module")
        ids = lambda state: {h for j, w, hs in state if (j, w) == (i, what) for h in hs}
        change = "added to" if ids(hooks_now) - ids(hooks) else "removed from"
        return f"a {what} was {change} {where} since the kept call"
    if dtypes != dtypes_now:
        i = next(i for i, (a, b) in enumerate(zip(dtypes, dtypes_now)) if a != b)
        return f"{reader.tensor_names[i]} is {dtypes_now[i]}, in the kept call {dtypes[i]}"
    name = _first(reader.parameter_names, grads, grads_now)
    return f"parameter {name} requires grad unlike in the kept call"


def _reads_its_flag(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward reads ``self.training`` (dropout, batch norm), a dropout only with p > 0
    (at p = 0 both modes return its input)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p == 0:
        return False
    forward = getattr(type(module).forward, "__code__", None)
    return forward is not None and "training" in forward.co_names


def _first(names: list[str], a: tuple, b: tuple) -> str:
    """The name of the first position where ``a`` and ``b`` differ."""
    return next((name for name, x, y in zip(names, a, b) if x != y), "?")


def first_difference(kept: tuple, now: tuple) -> str:
    """The first argument (by its path in the call) where two calls' signatures differ (see Call.signature), and
    how: its dtype, its shape, its device or its value (a constant)."""
    (kept_spec, kept_leaves), (spec, leaves) = kept, now
    if kept_spec != spec:
        names, kept_names = set(argument_paths(spec)), set(argument_paths(kept_spec))
        return (", ".join(sorted(names ^ kept_names)) or "tree") + " passed in one call and not in the other"
    i = next((i for i, (a, b) in enumerate(zip(kept_leaves, leaves)) if a != b), 0)
    mine, theirs = leaves[i], kept_leaves[i]
    if isinstance(mine, tuple) and isinstance(theirs, tuple) and len(mine) == len(theirs) == 4:
        what = next(n for n, a, b in zip(("shape", "dtype", "device", "rows"), mine, theirs) if a != b)
        index = ("shape", "dtype", "device", "rows").index(what)
        return f"{argument_paths(spec)[i]} has {what} {mine[index]}, the kept call's {theirs[index]}"
    return f"{argument_paths(spec)[i]} is {mine!r}, the kept call's {theirs!r}"


def dtype_differences(kept: tuple, now: tuple) -> dict[int, torch.dtype] | None:
    """Where two calls' signatures (see Call.signature) differ in some tensor arguments' dtypes and in nothing
    else: those arguments' leaf positions, each with the kept call's dtype (None: they differ otherwise, or not)."""
    (kept_spec, kept_leaves), (spec, leaves) = kept, now
    if kept_spec != spec:
        return None
    differences = {}
    for i, (theirs, mine) in enumerate(zip(kept_leaves, leaves)):
        if theirs == mine:
            continue
        if not (isinstance(mine, tuple) and isinstance(theirs, tuple) and len(mine) == len(theirs) == 4
                and (mine[0], *mine[2:]) == (theirs[0], *theirs[2:])):
            return None
        differences[i] = theirs[1]
    return differences or None


def row_keys(inputs: tuple[torch.Tensor, ...]) -> list[tuple]:
    """A hashable digest of each row's inputs: a weighted sum of the row's 32-bit words in integers, exact whatever
    the batch it sits in (a float reduction would round differently in a batch of 4 than alone). Equal rows give
    equal digests; a match is then checked bitwise."""
    words = torch.cat([_words(t) for t in inputs], dim=1).to(torch.int64)
    return [tuple(row) for row in (words * _weights(words.shape[1], words.device)).sum(1, keepdim=True).tolist()]


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as 32-bit words (bytes widened where a row's size is not a multiple of 4)."""
    flat = t.detach().reshape(t.shape[0], -1)
    # Read in place where it is row-major with unit stride, else copied (a broadcast sigma, stride 0, cannot be
    # reinterpreted; a size-1 dimension counts as contiguous whatever its stride).
    in_place = flat.is_contiguous() and (flat.shape[1] == 0 or flat.stride(1) == 1)
    data = (flat if in_place else flat.new_empty(flat.shape).copy_(flat)).view(torch.uint8)
    return data.view(torch.int32) if data.shape[1] % 4 == 0 else data.to(torch.int32)


@functools.lru_cache(maxsize=64)
def _weights(n: int, device: torch.device) -> torch.Tensor:
    # Random, not an arithmetic progression: with evenly spaced weights two rows that differ by the same amount at
    # two pairs of equally spaced places (tokens swapped, and their mask likewise) collide. Drawn on the CPU from a
    # fixed seed, so that every device and process agrees. Elementwise product and sum: CUDA has no integer
    # matrix product.
    return torch.randint(1, 2**31, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64,
                         device="cpu").to(device)
