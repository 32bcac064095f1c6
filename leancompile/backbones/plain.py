"""A module's tree without the hooks that distributed wrappers add, for tracing."""
from __future__ import annotations

import sys

import torch


# Set on the classes leancompile.wrap generates (its runtime lives in the module's ``_leancompile_*`` attributes).
WRAPPED_CLASS = "_leancompile_wrapped_class"


def fully_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2's ``fully_shard`` made ``module`` an ``FSDPModule``, without importing torch.distributed.fsdp
    (a few tenths of a second, sympy included): while it is not imported, no module is sharded by it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def fsdp1_unit(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 ``FullyShardedDataParallel`` unit (without importing torch.distributed.fsdp)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)


def zero3_partitioned(t: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned parameter ``t`` (without importing deepspeed): its data is empty outside
    the calls of the module that owns it, and its values live in its partition (``ds_tensor``)."""
    return hasattr(t, "ds_id")


def zero3_sharded(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned parameters of ``module``."""
    return any(map(zero3_partitioned, module.parameters()))


def zero3_leaf(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ZeRO-3 leaf module (DeepSpeed's ``set_z3_leaf_modules``): its own forward hooks gather
    every parameter of its tree at once, and its submodules have none."""
    return bool(getattr(module, "_z3_leaf", False))


def whole_shape(p: torch.Tensor) -> torch.Size:
    """The shape of parameter ``p`` whole: a ZeRO-3 parameter's is ``ds_shape`` (its data is empty between calls)."""
    return p.ds_shape if zero3_partitioned(p) else p.shape


def framework_hook(hook) -> bool:
    """Whether ``hook`` is a sharding framework's own: a method of FSDP2's state, or one of DeepSpeed ZeRO-3's
    functions (they gather and free the weights around a call, count its backward, reduce its gradients)."""
    owner = getattr(hook, "__self__", None)
    if owner is not None:
        return type(owner).__module__.startswith("torch.distributed.fsdp")
    module = getattr(hook, "__module__", None) or ""
    if module == "deepspeed.utils.nvtx":  # DeepSpeed's profiling wrapper: the function it wraps says
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
        return "func" in cells and framework_hook(cells["func"].cell_contents)
    return module.startswith("deepspeed.runtime.zero")


def fsdp1_unit_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP1 unit that is a stack's ``block``, or that a checkpoint wrapper ``block`` holds (activation
    checkpointing applied before FSDP1 wrapped the blocks); None: the block is no unit."""
    if fsdp1_unit(block):  # first: a unit hands attribute lookups it misses to the module it holds
        return block
    held = getattr(block, "_checkpoint_wrapped_module", None)
    return held if fsdp1_unit(held) else None


def fsdp1_routed(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The module whose forward serves a stack's ``block`` (the one its FSDP1 unit holds: the unit's own forward
    gathers and frees around it), and the checkpoint wrapper around that unit (None: none)."""
    unit = fsdp1_unit_of(block)
    if unit is None:
        return block, None
    return unit._fsdp_wrapped_module, None if unit is block else block


def fsdp1_originals(module: torch.nn.Module) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Size]]:
    """Per ``(id(submodule), name)`` of each original parameter that an FSDP1 unit in ``module``'s tree flattened
    with ``use_orig_params=True``: the original ``nn.Parameter`` (its data FSDP1's view into the sharded flat
    parameter outside a forward; the variable the optimizer steps) and its unsharded shape. Inside a unit's forward
    FSDP1 registers plain tensors instead, views into the gathered flat parameter, whose storage it frees."""
    originals = {}
    for unit in module.modules():
        handle = getattr(unit, "_handle", None) if fsdp1_unit(unit) else None
        if handle is None or not handle._use_orig_params:
            continue
        flat = handle.flat_param
        for info, param, shape in zip(flat._param_infos, flat._params, flat._shapes):
            originals[id(info.module), info.param_name] = (param, shape)
        for info, param in zip(flat._shared_param_infos, flat._shared_params):
            prim = originals.get((id(info.prim_module), info.prim_param_name))
            originals[id(info.module), info.param_name] = (param, prim[1] if prim else param.shape)
    return originals


def fsdp1_views(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each parameter that an FSDP1 unit flattened with ``use_orig_params=False`` in ``module``'s tree, by the name
    its module reads it by: FSDP1 registers none of them, and sets each as a plain tensor attribute viewing the flat
    parameter (the gathered one inside the unit's forward, which autograd tracks into the flat parameter)."""
    views, seen = [], set()
    for prefix, m in module.named_modules():
        for name, t in vars(m).items():
            flat = t._base if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) else None
            if _flat(flat) and flat._params is None and id(t) not in seen:
                seen.add(id(t))
                views.append((f"{prefix}.{name}" if prefix else name, t))
    return views


def parameters_by_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters by the names its forward reads them by: its registered ones, and those FSDP1
    flattened with ``use_orig_params=False`` (see :func:`fsdp1_views`) in place of their flat parameter, which
    FSDP1 registers on the module its unit holds and which no forward reads."""
    registered = {name: p for name, p in module.named_parameters() if not _flat(p)}
    return {**dict(fsdp1_views(module)), **registered}


def _flat(t) -> bool:
    """Whether ``t`` is an FSDP1 ``FlatParameter`` (without importing torch.distributed.fsdp)."""
    return getattr(t, "_param_infos", None) is not None


def fsdp1_shard(t: torch.Tensor) -> torch.Tensor:
    """What determines the values of ``t`` where it is an FSDP1 flat parameter: its sharded full-precision local
    shard, whatever FSDP1 has swapped in now (the gathered flat parameter, which the root keeps after its forward;
    the low-precision shard under mixed precision); else ``t``."""
    return getattr(t, "_local_shard", t) if _flat(t) else t


def _fsdp1_original(m: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor:
    """The original parameter behind ``p``, where ``p`` is FSDP1's view into a gathered flat parameter registered on
    ``m`` during a unit's forward (its base is the ``FlatParameter``); else ``p``."""
    flat = p._base if isinstance(p, torch.Tensor) and not isinstance(p, torch.nn.Parameter) else None
    if flat is None or getattr(flat, "_params", None) is None:
        return p
    for info, param in zip(flat._param_infos, flat._params):
        if info.module is m and info.param_name == name:
            return param
    for info, param in zip(flat._shared_param_infos, flat._shared_params):
        if info.module is m and info.param_name == name:
            return param
    return p


def named_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module.named_parameters()``, each parameter FSDP2 manages given as its sharded DTensor whatever FSDP2 has
    registered now: between a forward and its backward (and after a root's forward, which FSDP2 does not reshard) the
    module holds the unsharded parameter, whose storage FSDP2 frees when it reshards. Likewise each parameter FSDP1
    flattened with ``use_orig_params=True`` is given as its original ``nn.Parameter`` (see :func:`fsdp1_originals`),
    never the view into the gathered flat parameter that a unit's forward registers."""
    sharded = {key: param for key, (param, _) in fsdp1_originals(module).items()}
    for m in module.modules():
        if fully_sharded(m):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    sharded[id(param._module_info.module), param._module_info.param_name] = param.sharded_param
    fsdp1 = "torch.distributed.fsdp" in sys.modules
    if not sharded and not fsdp1:
        return list(module.named_parameters())
    named, seen = [], set()
    for prefix, m in module.named_modules():
        for name, p in m._parameters.items():
            p = sharded.get((id(m), name), p)
            if fsdp1:
                p = _fsdp1_original(m, name, p)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                named.append((f"{prefix}.{name}" if prefix else name, p))
    return named


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree as its own classes, sharing its current parameters and buffers, without the
    sharding frameworks' hooks (FSDP2's would re-register the weights on the module and defeat a functional call;
    ZeRO-3's would gather, and its leaf module's backward hook reduce-scatter, inside a trace) and without a
    ``forward`` set on the instance (a block routed to a reuse engine): a functional call of it runs the class's
    forward."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    # fully_shard made the class FSDP<cls>(FSDPModule, cls), leancompile.wrap Wrapped<cls>(Wrapped, cls): the
    # module's own class is the last base
    while issubclass(cls, FSDPModule) or cls.__dict__.get(WRAPPED_CLASS):
        cls = cls.__bases__[-1]
    if fsdp1_unit(module):  # FSDP1's forward gathers and frees: the copy hands its calls to the module it wraps
        cls = _PassedThrough
    plain = object.__new__(cls)
    plain.__dict__.update({k: v for k, v in module.__dict__.items()
                           if k not in (STATE_KEY, REGISTRY_KEY, "forward") and not k.startswith("_leancompile")})
    plain._parameters = dict(module._parameters)
    plain._buffers = dict(module._buffers)
    plain._modules = {name: None if child is None else plain_copy(child) for name, child in module._modules.items()}
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        hooks = getattr(module, name)
        kept = type(hooks)((k, h) for k, h in hooks.items() if not framework_hook(h))
        setattr(plain, name, kept)
    return plain


class _PassedThrough(torch.nn.Module):
    """An FSDP1 unit in a :func:`plain_copy`: its calls go to the module it wraps, nothing gathered or freed (the
    tree keeps the unit, so that its modules are listed as the unit's are)."""

    def forward(self, *args, **kwargs):
        return self._fsdp_wrapped_module(*args, **kwargs)


def with_fake_weights(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """:func:`plain_copy` of ``module`` whose parameters are fake tensors of the whole parameters' shapes (a
    sharded DTensor's global shape, the shape an FSDP1 original parameter had before flattening) on ``device``, all
    of one ``FakeTensorMode``: tracing reads shapes, dtypes and devices, never values, so nothing is gathered.
    So are the views FSDP1 sets with ``use_orig_params=False`` (see :func:`fsdp1_views`), whose storage it frees
    between forwards. Buffers stay as they are (FSDP2 and FSDP1 do not shard them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    shapes = {key: shape for key, (_, shape) in fsdp1_originals(module).items()}
    plain = plain_copy(module)
    for (_, original), child in zip(module.named_modules(remove_duplicate=False),
                                    plain.modules(remove_duplicate=False)):
        for name, p in child._parameters.items():
            if p is not None:
                shape = shapes.get((id(original), name), p.ds_shape if zero3_partitioned(p) else None)
                fake = fake_like(p, mode, device) if shape is None else fake_like(
                    torch.empty(shape, dtype=p.dtype, device="meta"), mode, device)
                child._parameters[name] = torch.nn.Parameter(fake, p.requires_grad)
    for name, view in fsdp1_views(module):
        prefix, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(prefix), leaf, fake_like(view, mode, device).requires_grad_(view.requires_grad))
    return plain


def fake_like(t: torch.Tensor, mode, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` on ``device`` with ``t``'s shape, strides and dtype, read from its metadata alone:
    ``t`` may be a meta tensor, a fake tensor of another mode or a sharded DTensor (its global shape)."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
