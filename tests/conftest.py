import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from leancompile import backbones
from leancompile.tasks.synthetic import RandomPrompts, latent_reward

# benchmarks/ is a top-level folder, not part of the installed package; bare ``pytest`` does not put the
# repository root on sys.path the way ``python -m pytest`` does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Tiny models gain nothing from intra-op threads, and lose much when the cores are shared.
torch.set_num_threads(1)

# Each test compiles its own programs: the on-disk program cache (runtime.program_cache) would let one test's
# entries answer another's compile, past the failures some tests inject into it. tests/test_program_cache.py
# turns it on in a folder of its own.
os.environ["LEANCOMPILE_CACHE"] = "0"

# CI explores a fixed sample of each property (reproducible landings); runs elsewhere draw new examples. No
# deadline: the test files run in parallel worker processes, and a slow example is not a wrong one.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def planned_without_timings(monkeypatch):
    """auto as the tests see it does not depend on this machine's timings: the planner prices the per-row program
    as eager (no calibration, as for a named device), and the run-time check never falls back to native
    (tests/test_auto.py gives both their inputs)."""
    from leancompile.runtime import auto, calibration

    monkeypatch.setattr(calibration, "overheads", lambda device_type: None)
    monkeypatch.setattr(auto, "AUTO_FLOOR", 0.0)


# The library's synthetic task, under the names the tests use.
PromptTable = RandomPrompts
mean_reward = latent_reward


@pytest.fixture
def make_trainer():
    from leancompile.trainers import trainer_class

    def build(config, family="sd3", seed=0, reward=mean_reward):
        backbone = backbones.tiny(family, seed=seed)
        prompts = PromptTable(backbone)
        cls = trainer_class(config.algorithm)
        return cls(config, backbone, reward, prompts, uncond=prompts.uncond if config.use_cfg else None)

    return build


def mark_optimizer_steps(trainer):
    """Record, at each optimizer step of ``trainer`` (an optimized trainer), how many backbone calls the engine
    had logged; returns the list it fills."""
    marks, step = [], trainer.optimizer.step

    def marking(*args, **kwargs):
        marks.append(len(trainer._engine.log.records) if trainer._engine is not None else 0)
        return step(*args, **kwargs)

    trainer.optimizer.step = marking
    return marks


def check_served_calls(trainer, marks, every_call_served: bool):
    """Calls with grad before the step's first optimizer step are served (or recompute because no kept row has
    their inputs, e.g. a later epoch's other trained steps); none is served after it (the weights changed)."""
    records = getattr(trainer, "last_calls", [])
    first = marks[0] if marks else len(records)
    before = [r for r in records[:first] if r.action in ("served", "recomputed")]
    after = [r for r in records[first:] if r.action in ("served", "recomputed")]
    assert all(r.action == "served" or r.kind == "inputs" for r in before), [r for r in before]
    if every_call_served and before:
        assert any(r.action == "served" for r in before), before
    assert all(r.action == "recomputed" and r.kind in ("weights", "nothing kept", "inputs") for r in after), after


def spawn_ranks(worker, world: int, out, *args) -> list:
    """Run ``worker(rank, port, *args, out)`` in ``world`` processes on a free local port; each writes
    ``out/rank{rank}.pt``, which is returned in rank order."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(port, *args, str(out)), nprocs=world)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
