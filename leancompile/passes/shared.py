"""Shared-backbone detection: find the backbone computation the update repeats from the rollout.

Every node of both programs gets a structural hash (a Merkle hash of its op and its arguments' hashes, where a
placeholder hashes as its role, ``param:<name>`` or ``data:<name>``, and a constant tensor as its value). Two
nodes with equal hashes compute the same function of the same parameters and of the same rollout buffers at the
same ``(rows, steps)`` indices: stacking, indexing, shuffling (the indices), casts and CFG batch doubling are all
part of the hashed expression. An update backbone call whose output hash equals a rollout call's output hash is
therefore provably a recomputation of it.

Writes ``node.meta[SHARED]`` (update node -> its rollout twin) and ``node.meta[PROVENANCE]`` (on each call's
inputs: the row layout of the batch it feeds, e.g. two segments for ``[uncond, cond]``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from .graph import ancestors, op_name
from .meta import CALL, INPUT, PROVENANCE, SHARED

# Ops that only move or cast rows; the provenance walk looks through them.
_ROW_OPS = {"index.Tensor", "index_select.default", "select.int", "slice.Tensor", "expand.default", "view.default",
            "_unsafe_view.default", "reshape.default", "clone.default", "_to_copy.default", "unsqueeze.default",
            "squeeze.dim", "alias.default", "detach.default", "repeat.default", "permute.default"}


@dataclass(frozen=True)
class RowLayout:
    """How a backbone call's batch is laid out: ``segments`` consecutive blocks of the micro-batch's rows
    (2 for classifier-free guidance's ``[uncond, cond]``), each gathered from ``sources``."""

    segments: int
    sources: tuple[tuple[str, ...], ...]  # per segment: the data placeholders it reads


@dataclass(frozen=True)
class SharedBackbone:
    """What the detection found: for each update backbone call, its rollout twin or why it has none."""

    pairs: tuple[tuple[int, int], ...]  # (update call index, rollout call index)
    layout: RowLayout | None  # the row layout of the shared call's batch
    parameters: tuple[str, ...]  # the parameters the shared call reads
    nodes: int  # backbone nodes of the update that are reused
    unshared: tuple[tuple[int, str], ...]  # (update call index, reason)
    numerics_only: bool = False  # the pair matched only modulo casts or kernel flags: the numerics differ

    @property
    def found(self) -> bool:
        return bool(self.pairs)


def _hash_constant(value) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return f"tensor{tuple(data.shape)}{data.dtype}:" + hashlib.sha1(data.numpy().tobytes()).hexdigest()[:16]
    return repr(value)


# Arguments that choose only which extra outputs an attention kernel writes: a no-grad rollout asks for no
# log-sum-exp, an update that saves for its backward asks for one. The mem-efficient kernel computes its output
# the same way either way; cuDNN builds another graph (which may round differently), so there the flag is a
# numerics-only difference, like a cast. Positional index of the flag per op.
_OUTPUT_NEUTRAL_FLAGS = {"_scaled_dot_product_efficient_attention.default": 4}
_NUMERICS_NEUTRAL_FLAGS = {"_scaled_dot_product_cudnn_attention.default": 4}


def _hashed_args(node: fx.Node, numerics_neutral: bool) -> tuple:
    name = op_name(node)
    flag = _OUTPUT_NEUTRAL_FLAGS.get(name, _NUMERICS_NEUTRAL_FLAGS.get(name) if numerics_neutral else None)
    if flag is None or len(node.args) <= flag:
        return node.args
    return (*node.args[:flag], None, *node.args[flag + 1:])


def structural_hashes(gm: fx.GraphModule, numerics_only: bool = False) -> dict[fx.Node, str]:
    """The Merkle hash of every node (see the module docstring). With ``numerics_only`` a dtype cast hashes as its
    input, and cuDNN attention with and without its log-sum-exp alike, so two programs that differ only in
    numerics (e.g. an fp16 round trip before the backbone) match."""
    hashes: dict[fx.Node, str] = {}

    def arg_key(a):
        if isinstance(a, fx.Node):
            return hashes[a]
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(arg_key(x) for x in a) + ")"
        return _hash_constant(a) if isinstance(a, torch.Tensor) else repr(a)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            key = node.meta.get(INPUT, node.name)
        elif node.op == "get_attr":
            key = "const:" + _hash_constant(getattr(gm, node.target))
        elif numerics_only and op_name(node) == "_to_copy.default":
            hashes[node] = hashes[node.args[0]]
            continue
        else:
            key = (op_name(node) + arg_key(_hashed_args(node, numerics_only))
                   + arg_key(tuple(sorted(node.kwargs.items()))))
        hashes[node] = hashlib.sha1(key.encode()).hexdigest()
    return hashes


def backbone_calls(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    calls: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if CALL in node.meta:
            calls.setdefault(node.meta[CALL].index, []).append(node)
    return calls


def call_boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """A call region's inputs (outside nodes it reads) and outputs (its nodes read outside it)."""
    region = set(nodes)
    inputs, outputs = [], []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in region and arg not in inputs:
                inputs.append(arg)
        if any(user not in region for user in node.users):
            outputs.append(node)
    return inputs, outputs


def _sources(node: fx.Node) -> tuple[str, ...]:
    """The data placeholders a value is gathered from."""
    roles = (n.meta.get(INPUT, "") for n in ancestors(node))
    return tuple(sorted(role[5:] for role in roles if role.startswith("data:")))


def row_layout(latent_input: fx.Node) -> RowLayout:
    """The segments of the batch fed to a call: a ``cat`` along dim 0 of row-gathered parts is one segment each."""
    node = latent_input
    while node.op == "call_function" and op_name(node) in _ROW_OPS - {"index.Tensor"}:
        node = node.args[0]
    if node.op == "call_function" and op_name(node) == "cat.default" and (len(node.args) < 2 or node.args[1] == 0):
        parts = node.args[0]
        return RowLayout(len(parts), tuple(_sources(p) for p in parts))
    return RowLayout(1, (_sources(node),))


def _latent_input(inputs: list[fx.Node]) -> fx.Node:
    """The call input that carries the latents (the one gathered from the ``latents`` buffer, largest first)."""
    candidates = [n for n in inputs if "latents" in _sources(n)]
    return max(candidates, key=lambda n: n.meta["val"].numel()) if candidates else inputs[0]


def _first_nodes_by_hash(calls: dict[int, list[fx.Node]], hashes: dict[fx.Node, str]):
    by_hash = {}
    for index, nodes in calls.items():
        for node in nodes:
            by_hash.setdefault(hashes[node], (index, node))
    return by_hash


def _twin(outputs, hashes, by_hash) -> int | None:
    matches = [by_hash.get(hashes[o]) for o in outputs]
    if all(matches) and len({m[0] for m in matches}) == 1:
        return matches[0][0]
    return None


def detect_shared_backbone(rollout: fx.GraphModule, update: fx.GraphModule) -> SharedBackbone:
    """Pair each update backbone call with the rollout call it recomputes, if any: exactly, or else modulo dtype
    casts (a numerics difference the validity pass reports)."""
    r_calls, u_calls = backbone_calls(rollout), backbone_calls(update)
    exact = (structural_hashes(rollout), structural_hashes(update))
    loose = (structural_hashes(rollout, numerics_only=True), structural_hashes(update, numerics_only=True))
    pairs, unshared, layout, params, reused, numerics_only = [], [], None, (), 0, False
    for index, nodes in u_calls.items():
        call = nodes[0].meta[CALL]
        inputs, outputs = call_boundary(nodes)
        if not call.grad_enabled:
            unshared.append((index, "runs without grad (e.g. the KL reference): nothing to reuse for a backward"))
            continue
        for (r_hash, u_hash), is_loose in ((exact, False), (loose, True)):
            by_hash = _first_nodes_by_hash(r_calls, r_hash)
            twin = _twin(outputs, u_hash, by_hash)
            if twin is not None:
                break
        if twin is None:
            unshared.append((index, _why_unshared(update, nodes, exact[1], r_calls, exact[0])))
            continue
        pairs.append((index, twin))
        numerics_only = numerics_only or is_loose
        for node in nodes:
            if u_hash[node] in by_hash:
                node.meta[SHARED] = by_hash[u_hash[node]][1].name
                reused += 1
        layout = row_layout(_latent_input(inputs))
        for node in inputs:
            node.meta[PROVENANCE] = layout
        for node in call_boundary(r_calls[twin])[0]:
            node.meta[PROVENANCE] = layout
        params = tuple(sorted(n.meta[INPUT][6:] for n in inputs if n.meta.get(INPUT, "").startswith("param:")))
    return SharedBackbone(tuple(pairs), layout, params, reused, tuple(unshared), numerics_only)


def _why_unshared(update, nodes, u_hash, r_calls, r_hash) -> str:
    inputs, _ = call_boundary(nodes)
    rollout_inputs = {r_hash[n] for nodes_r in r_calls.values() for n in call_boundary(nodes_r)[0]}
    differing = [n for n in inputs if u_hash[n] not in rollout_inputs]
    if differing:
        roles = [n.meta.get(INPUT) or f"{n.name} (from {', '.join(_sources(n)) or 'constants'})" for n in differing]
        return "its inputs differ from every rollout call's: " + "; ".join(roles[:4])
    return "its computation differs from every rollout call's (different ops or parameters)"
