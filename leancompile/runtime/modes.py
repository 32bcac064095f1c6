"""Whether a module computes the same in two training modes: a rollout in ``eval()`` and an update in ``train()``
may share calls where every submodule that reads its flag reads it to no effect (see :class:`ModeProof`)."""
from __future__ import annotations

import itertools

import torch
from torch.utils import _pytree as pytree

from ..backbones.plain import with_fake_weights
from .calls import Call
from .identity import CallState, StateReader
from .rowwise import _compiling


class ModeProof:
    """For one module (``reader`` reads its states): whether it computes the same under two calls' training flags,
    each answer found once per pair of compile keys."""

    def __init__(self, backbone: torch.nn.Module, reader: StateReader):
        self.backbone, self.reader = backbone, reader
        # (kept call's compile key, call's compile key) -> why the two training modes compute differently (None:
        # they compute the same), and each mode's traced forward by compile key
        self._modes: dict[tuple, str | None] = {}
        self._mode_graphs: dict[tuple, torch.fx.GraphModule] = {}

    def __call__(self, kept: CallState, state: CallState, call: Call) -> str | None:
        """Why the module computes differently under ``state``'s training flags than under the kept call's (None:
        it computes the same): its forward traced in each mode, the blocks included, on fake weights (nothing is
        gathered), and the two graphs compared. A submodule that reads its flag where it changes the result
        (dropout with p > 0 draws random numbers in train mode, batch norm uses the batch's statistics) gives two
        graphs; one that reads it to no effect (dropout with p = 0) gives one. Each block's engine then compares
        its own one-row programs in both modes before it serves (see ReuseEngine._modes_agree)."""
        pair = (kept.compile_key, state.compile_key)
        if pair not in self._modes:
            try:
                theirs, mine = (self.traced(s, call) for s in (kept, state))
            except Exception as error:  # what does not trace cannot be shown to compute the same
                self._modes[pair] = (f"the module's forward does not trace in both training modes "
                                     f"({type(error).__name__}: {error}), so it cannot be shown to compute the same")
            else:
                self._modes[pair] = None if mine.code == theirs.code else _where_modes_differ(
                    theirs, mine, kept.explain(state, self.reader))
        return self._modes[pair]

    def traced(self, state: CallState, call: Call) -> torch.fx.GraphModule:
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
