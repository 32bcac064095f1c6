"""One call of a module, split the way reuse needs it: tensors that carry the call's rows, tensors every row shares,
and constants.

Any module is called with a tree of arguments (a trainer's ``backbone(x, sigma, cond)``, a diffusers transformer's
keyword arguments, a causal LM's ``input_ids`` and ``attention_mask``). The call's batch is the leading size of its
first tensor; every tensor with that leading size carries rows (a row of the output depends on the same row of
each), every other tensor is shared whole by all rows (Flux's ``img_ids``), and the other leaves are constants that
the compiled program bakes in (``return_dict=False``). Keyword arguments named in ``shared`` are shared whatever
their size: a shared tensor whose leading size happens to equal the batch must be named there.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class Call:
    args: tuple
    kwargs: dict
    leaves: tuple  # the arguments' leaves in pytree order
    spec: pytree.TreeSpec
    rows: tuple[bool, ...]  # per leaf: a tensor with the call's rows on dimension 0
    batch: int
    refusal: str | None  # why this call cannot be kept or served (None: it can)
    # What identifies its rows, where not its own row inputs: a block's call inside a verified backbone call is
    # identified by the backbone call's rows (see runtime.regional)
    verified_rows: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def of(cls, args: tuple, kwargs: dict, shared: frozenset[str] = frozenset()) -> "Call":
        if shared:
            flat, spec = pytree.tree_flatten_with_path((args, kwargs))
            leaves, named = tuple(leaf for _, leaf in flat), tuple(_named(path, shared) for path, _ in flat)
        else:  # the paths cost as much again: only read where names are given
            leaves, spec = pytree.tree_flatten((args, kwargs))
            leaves, named = tuple(leaves), (False,) * len(leaves)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()]
        batch = tensors[0].shape[0] if tensors else 0
        rows = tuple(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch and not name
                     for leaf, name in zip(leaves, named))
        refusal = None if tensors else "no tensor argument with a batch dimension"
        odd = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor) and not _constant(leaf)]
        if odd:
            path = pytree.keystr(pytree.tree_flatten_with_path((args, kwargs))[0][odd[0]][0])
            refusal = f"argument {path} of type {type(leaves[odd[0]]).__name__} is not a tensor or a constant"
        return cls(args, kwargs, leaves, spec, rows, batch, refusal)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor leaves, in order: what a compiled program of this call takes after the weights."""
        return tuple(leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor))

    @property
    def row_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for leaf, row in zip(self.leaves, self.rows) if row)

    @property
    def identity_rows(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose rows identify the call's rows: compared bitwise with a kept call's."""
        return self.row_inputs if self.verified_rows is None else self.verified_rows

    @property
    def whole_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(leaf for leaf, row in zip(self.leaves, self.rows) if not row and isinstance(leaf, torch.Tensor))

    @property
    def tensor_rows(self) -> tuple[bool, ...]:
        """Per tensor leaf: whether it carries rows."""
        return tuple(row for leaf, row in zip(self.leaves, self.rows) if isinstance(leaf, torch.Tensor))

    @property
    def device(self) -> torch.device:
        return self.row_inputs[0].device

    def signature(self) -> tuple:
        """What a program compiled for one row of this call depends on: the tree, the constants, and each tensor's
        shape (without the rows where it has them), dtype and device."""
        return (self.spec,
                tuple((tuple(leaf.shape[1:] if row else leaf.shape), leaf.dtype, leaf.device, row)
                      if isinstance(leaf, torch.Tensor) else leaf for leaf, row in zip(self.leaves, self.rows)))

    def with_tensors(self, tensors) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the tensor leaves replaced by ``tensors`` (in order)."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def argument_paths(spec) -> list[str]:
    """Each leaf's path in a call's ``(args, kwargs)`` tree, as ``kwargs['name']`` or ``args[0]``."""
    tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    flat = pytree.tree_flatten_with_path(tree)[0]
    return [("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:]) for path, _ in flat]


def row_input_names(call: Call) -> list[str]:
    """The path of each of the call's row inputs (``kwargs['timestep']``), in the order of ``row_inputs``."""
    return [path for path, row in zip(argument_paths(call.spec), call.rows) if row]


def call_signature(forward, skip_first: bool = False) -> inspect.Signature | None:
    """The signature a call of ``forward`` binds to, without the module's own parameter where ``forward`` is a
    method (or ``skip_first``: an unbound function whose first parameter is the module); None where it has none."""
    function = getattr(forward, "__func__", forward)
    return _signature(function, skip_first or function is not forward)


@functools.lru_cache(maxsize=256)
def _signature(function, skip_first: bool) -> inspect.Signature | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or a callable without one
        return None
    parameters = list(signature.parameters.values())
    return signature.replace(parameters=parameters[1:] if skip_first else parameters)


def bound(forward, args: tuple, kwargs: dict, skip_first: bool = False) -> tuple[tuple, dict]:
    """``(args, kwargs)`` as ``forward`` binds them, with every argument that has a name passed by name and every
    omitted one whose default is a constant given its default: ``x=None`` passed and left out to its default
    ``None`` are one call, as are the positional and the keyword spelling of an argument. Arguments that have no
    name (positional-only ones, ``*args``) stay positional. Arguments ``forward`` does not bind are left as they
    are (the module raises its own error when it runs). ``skip_first``: ``forward`` is an unbound function whose
    first parameter (the module) is not among ``args``."""
    signature = call_signature(forward, skip_first)
    if signature is None:
        return args, kwargs
    parameters = list(signature.parameters.values())
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return args, kwargs
    # Parameters before a non-empty ``*args`` can only be passed positionally
    variadic = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_POSITIONAL
                     and arguments.get(p.name)), -1)
    positional, named = [], {}
    for i, parameter in enumerate(parameters):
        if parameter.name in arguments:
            value = arguments[parameter.name]
        elif parameter.default is not parameter.empty and _constant(parameter.default):
            value = parameter.default
        else:
            continue
        if parameter.kind is parameter.POSITIONAL_ONLY:
            positional.append(value)
        elif parameter.kind is parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif parameter.kind is parameter.VAR_KEYWORD:
            named.update(value)
        elif i < variadic:
            positional.append(value)
        else:
            named[parameter.name] = value
    return tuple(positional), named


def named_forward(module: torch.nn.Module):
    """The forward whose signature names the call's arguments: a pass-through ``forward(*args, **kwargs)`` (peft's
    ``PeftModel``, DDP, torch's ``checkpoint_wrapper``, ``torch.compile``'s module) binds as the module it hands them
    to, so that ``x=None`` passed and omitted, or an argument passed by position and by name, are one call."""
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        forward = module.forward
        signature = call_signature(forward)
        if signature is None:
            return forward
        if not {p.kind for p in signature.parameters.values()} <= {inspect.Parameter.VAR_POSITIONAL,
                                                                    inspect.Parameter.VAR_KEYWORD}:
            return forward
        inner = module.get_base_model() if hasattr(module, "get_base_model") else next(
            (getattr(module, name) for name in _INNER if isinstance(getattr(module, name, None), torch.nn.Module)), None)
        if inner is None:
            return forward
        module = inner
    return module.forward


# Where a pass-through module holds the module it calls: DDP's, checkpoint_wrapper's, torch.compile's
_INNER = ("module", "_checkpoint_wrapped_module", "_orig_mod")


def _named(path, names: frozenset[str]) -> bool:
    """Whether a leaf's path lies under a keyword argument named in ``names``."""
    return len(path) > 1 and getattr(path[0], "idx", None) == 1 and getattr(path[1], "key", None) in names


def _constant(value) -> bool:
    """A leaf a compiled program can bake in and a signature can compare."""
    return value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device))


@dataclass(frozen=True)
class OutputLayout:
    """A module's output as one tensor with its rows on dimension 0, and back. One tensor leaf is that tensor;
    several (a transformer block's image and text states) are flattened per row and concatenated, and split again
    on the way out (their cotangents are assembled by autograd). Leaves that are not tensors are constants."""

    spec: pytree.TreeSpec
    leaves: tuple  # per leaf: the constant (a tensor leaf's entry is unused)
    tensor: tuple[bool, ...]  # per leaf: a tensor
    shapes: tuple[tuple[int, ...], ...] = ()  # per tensor leaf, its shape without the rows (several leaves only)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not self.shapes:
            return tensors[0]
        return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)

    def unpack(self, packed: torch.Tensor, copy: bool = False):
        """The module's output tree around ``packed`` (this layout's rows on dimension 0). Several tensors are copies,
        not views of ``packed``: the caller may write into them in place, and FSDP2's pre-backward hook on a block's
        output is lost by an in-place write into a view. One tensor is ``packed`` itself unless ``copy``."""
        if not self.shapes:
            tensors = iter([packed.clone() if copy else packed])
        else:
            sizes = [math.prod(shape) for shape in self.shapes]
            tensors = iter(part.reshape(packed.shape[0], *shape).clone()
                           for part, shape in zip(packed.split(sizes, dim=1), self.shapes))
        return pytree.tree_unflatten([next(tensors) if t else leaf for leaf, t in zip(self.leaves, self.tensor)],
                                     self.spec)


def output_layout(output) -> tuple[torch.Tensor | None, OutputLayout | None, str | None]:
    """A module's output packed into one tensor and its layout (or None, None and why it cannot be kept)."""
    leaves, spec = pytree.tree_flatten(output)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    odd = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor) and not _constant(leaf)]
    if not tensors or odd:
        kinds = ", ".join(type(leaf).__name__ for leaf in leaves)
        return None, None, f"the output has leaves ({kinds}); a kept call returns tensors and constants"
    constants = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    is_tensor = tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)
    if len(tensors) == 1:
        return tensors[0], OutputLayout(spec, constants, is_tensor), None
    rows = {t.shape[0] if t.dim() else None for t in tensors}
    dtypes = {t.dtype for t in tensors}
    if len(rows) != 1 or None in rows or len(dtypes) != 1:
        return None, None, ("the output's tensors differ in their leading size or dtype; a kept call's tensors "
                            "share both")
    layout = OutputLayout(spec, constants, is_tensor, tuple(tuple(t.shape[1:]) for t in tensors))
    return layout.pack(tensors), layout, None
