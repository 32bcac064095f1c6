"""Trainer state in one safetensors file: trainable weights, optimizer moments, EMA, generator states, counters.

The file is written next to its destination and renamed over it, so a run killed at any moment leaves either the
previous checkpoint or the new one, never a torn file. Nothing is unpickled on load: tensors come from
safetensors and the rest from a JSON string in its metadata.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 1


def save_checkpoint(trainer, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{n}": p.detach().contiguous() for n, p in zip(trainer.trainable_names, trainer.trainable)}
    optim = trainer.optimizer.state_dict()
    for index, state in optim["state"].items():
        for key, value in state.items():
            tensors[f"optim/{index}/{key}"] = torch.as_tensor(value).contiguous()
    for name, value in trainer.ema_parameters().items():
        tensors[f"ema/{name}"] = value.contiguous()
    for name, gen in trainer.generators.items():
        tensors[f"rng/{name}"] = gen.get_state()
    meta = {
        "format": FORMAT_VERSION,
        "config": trainer.config.to_dict(),
        "global_step": trainer.global_step,
        "optimizer_steps": trainer.optimizer_steps,
        "param_groups": optim["param_groups"],
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata={"leancompile": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(trainer, path: str | os.PathLike) -> None:
    """Restore ``trainer`` (built with the same config and backbone) to the saved state, bitwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint path {str(path)!r} does not exist; pass a file written by save_checkpoint")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["leancompile"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    saved, current = meta["config"], trainer.config.to_dict()
    differing = sorted(k for k in saved.keys() | current.keys()
                       if json.dumps(saved.get(k)) != json.dumps(current.get(k)))
    if differing:
        raise ValueError(f"checkpoint {str(path)!r} was written with a different config; differing fields: {differing}")
    missing = [n for n in trainer.trainable_names if f"param/{n}" not in tensors]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks trainable parameters {missing[:3]}...; wrong backbone?")
    with torch.no_grad():
        for name, param in zip(trainer.trainable_names, trainer.trainable):
            param.copy_(tensors[f"param/{name}"])
        for name, value in zip(trainer.trainable_names, trainer.ema or []):
            value.copy_(tensors[f"ema/{name}"])
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, index, field = key.split("/", 2)
            state.setdefault(int(index), {})[field] = value
    trainer.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    for name, gen in trainer.generators.items():
        gen.set_state(tensors[f"rng/{name}"])
    trainer.global_step = meta["global_step"]
    trainer.optimizer_steps = meta["optimizer_steps"]
