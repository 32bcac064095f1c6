import os
import shutil
import sys
import tempfile
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

# The program cache on disk (runtime.program_cache) is this run's own, shared by its worker processes and the ranks
# they spawn: a graph one test compiled is read by the next that compiles it, as a user's second process reads it
# (each is compiled for real once per run). Tests that inject failures into the compile turn it off
# (tests/test_no_trace.py); tests/test_program_cache.py gives it folders of its own.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
os.environ["LEANCOMPILE_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"leancompile-tests-{_RUN}")
os.environ["LEANCOMPILE_CACHE"] = "1"


def pytest_sessionfinish(session):
    """The run's cache goes with the run (the controller, or a run without workers, removes it)."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["LEANCOMPILE_CACHE_DIR"], ignore_errors=True)

# CI explores a fixed sample of each property (reproducible landings); runs elsewhere draw new examples. No
# deadline: the test files run in parallel worker processes, and a slow example is not a wrong one.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def planned_without_timings():
    """auto as the tests see it does not depend on this machine's timings: the planner prices the per-row program
    as eager (no calibration, as for a named device), and the run-time check never falls back to native
    (tests/test_auto.py gives both their inputs). For the whole run, so that module-scoped fixtures (the
    benchmark's rows) see it too."""
    from leancompile.runtime import auto, calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "overheads", lambda device_type: None)
        patch.setattr(auto, "AUTO_FLOOR", 0.0)
        yield


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


def steps_clock(*program_seconds: float):
    """auto's clock (``runtime.auto.now``) under ``optimize``, read at the start and the end of each of a trainer's
    steps while its trials run, one trial per ``program_seconds``: its first step (which compiles) takes 5 s, then
    native's steps 1 s and the program's its seconds, alternately, through the verdict at its eighth step's start
    (the next trial's first step). Between two steps the caller takes 10 s, which is neither program's."""
    durations = [d for seconds in program_seconds for d in (5.0, 1.0, seconds, 1.0, seconds, 1.0, seconds)]
    times, at = [], 0.0
    for duration in durations:
        times += [at, at + duration]
        at += duration + 10.0
    return iter([*times, at]).__next__


def spawn_ranks(worker, world: int, out, *args) -> list:
    """Run ``worker(rank, port, *args, out)`` in ``world`` processes on a free local port; each writes
    ``out/rank{rank}.pt``, which is returned in rank order."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(port, *args, str(out)), nprocs=world)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
