"""Compiled per-row programs on disk, so that a second process running the same model at the same shapes reads
them instead of compiling them again.

A key is what decides the entry, never a guess about the module: a one-row partition is keyed by the joint graph
AOTAutograd traced from the live module (its code, its constants' values and its inputs' shapes, strides, dtypes
and devices) with the settings the partition and its passes read; a vmapped trace by the digest of the partition it
was traced from and the shapes it was traced at. Both also hold torch's version and a hash of leancompile's own
sources. Whatever changes what the module computes changes its joint graph, so no entry is read for another
program. The joint graph is still traced in every process (it is the key); what is read instead of computed is the
partition, its passes and every vmapped trace.

Graphs are stored node by node (each operator by its qualified name) and rebuilt as they were: names, constants
and code equal, which the reader checks against the stored digest. An entry is written whole (a temporary file
renamed into place, so that concurrent writers do not tear it); one that does not read back is compiled again.
``LEANCOMPILE_CACHE_DIR`` sets the folder (default ``$XDG_CACHE_HOME/leancompile``, else
``~/.cache/leancompile``); ``LEANCOMPILE_CACHE=0`` turns the cache off.
"""
from __future__ import annotations

import builtins
import functools
import hashlib
import importlib
import os
import pickle
import tempfile
from pathlib import Path

import torch
import torch.fx as fx


class Unstorable(ValueError):
    """A graph holds something that is not stored by name (a lambda, a closure): its entry is not written."""


def folder() -> Path | None:
    """Where entries live now (None: the cache is off). Read at each use: a test or a loop may set it late."""
    if os.environ.get("LEANCOMPILE_CACHE", "1") == "0":
        return None
    if os.environ.get("LEANCOMPILE_CACHE_DIR"):
        return Path(os.environ["LEANCOMPILE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "leancompile"


@functools.cache
def versions() -> str:
    """torch's version and a hash of leancompile's sources: a change to either (a pass, a decomposition) makes
    every entry another's."""
    h = hashlib.sha256(torch.__version__.encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def key(kind: str, *parts) -> str:
    """The entry's name for ``parts`` (their ``repr``, which holds shapes, dtypes, devices and digests)."""
    return f"{kind}-" + hashlib.sha256(repr((versions(), parts)).encode()).hexdigest()[:40]


def load(name: str):
    """The entry ``name``, or None where there is none or it does not read back."""
    where = folder()
    path = where / f"{name}.pkl" if where is not None else None
    if path is None or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # torn by a crash, or written by another torch: compiled again and rewritten
        return None


def store(name: str, entry) -> None:
    """Write ``entry`` as ``name``, whole or not at all (nothing is written where the folder cannot be made)."""
    where = folder()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, suffix=".tmp", delete=False) as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):  # a full disk, a value pickle refuses
        if "f" in locals():
            Path(f.name).unlink(missing_ok=True)
        return
    os.replace(f.name, where / f"{name}.pkl")


# --------------------------------------------------------------------------------------- graphs by name

class _Node:
    """A reference to an earlier node, by name, in a stored graph's arguments."""

    def __init__(self, name: str):
        self.name = name


def dump(gm: fx.GraphModule | None):
    """``gm`` as plain values: its nodes (operation, name, target by qualified name, arguments), its constants and
    its code generator (None stays None). Raises ``Unstorable`` for a target that has no importable name."""
    if gm is None:
        return None
    nodes = [(n.op, n.name, _target_name(n.target), _plain(n.args), _plain(n.kwargs)) for n in gm.graph.nodes]
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.find_nodes(op="get_attr")}
    return {"nodes": nodes, "constants": constants, "codegen": gm.graph._codegen}


def rebuild(stored) -> fx.GraphModule | None:
    """The graph module ``dump`` stored, with the same node names, constants and code."""
    if stored is None:
        return None
    graph, made = fx.Graph(), {}
    for op, name, target, args, kwargs in stored["nodes"]:
        made[name] = graph.create_node(op, _target(target), _made(args, made), _made(kwargs, made), name=name)
    graph._codegen = stored["codegen"]
    root = torch.nn.Module()
    for name, value in stored["constants"].items():
        setattr(root, name, value)
    return fx.GraphModule(root, graph)


def _target_name(target):
    if isinstance(target, str):  # placeholder, get_attr, output
        return target
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module is None or "<" in name:
        raise Unstorable(f"the graph calls {target!r}, which has no importable name")
    if _resolve(module, name) is not target:
        raise Unstorable(f"{module}.{name} is not the graph's {target!r}")
    return ("py", module, name)


def _target(stored):
    if isinstance(stored, str):
        return stored
    if stored[0] == "op":
        _, namespace, op, overload = stored
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    return _resolve(stored[1], stored[2])


def _resolve(module: str, qualname: str):
    value = builtins if module == "builtins" else importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def _plain(value):
    if isinstance(value, fx.Node):
        return _Node(value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if not hasattr(value, "_fields") else \
            type(value)(*(_plain(v) for v in value))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_plain(value.start), _plain(value.stop), _plain(value.step))
    return value


def _made(value, made: dict):
    if isinstance(value, _Node):
        return made[value.name]
    if isinstance(value, (list, tuple)):
        return type(value)(_made(v, made) for v in value) if not hasattr(value, "_fields") else \
            type(value)(*(_made(v, made) for v in value))
    if isinstance(value, dict):
        return {k: _made(v, made) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_made(value.start, made), _made(value.stop, made), _made(value.step, made))
    return value
