"""Measure one case: interleaved step times, FLOPs per step, retained bytes and weight agreement."""
from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

from torch.utils.flop_counter import FlopCounterMode

import leancompile
from leancompile import backbones
from leancompile.tasks.synthetic import RandomPrompts
from leancompile.trainers import DanceGRPOTrainer, FlowGRPOTrainer

from .cases import Case
from .task import NUM_PROMPTS, ProjectionReward

_TRAINERS = {"flowgrpo": FlowGRPOTrainer, "dancegrpo": DanceGRPOTrainer}


def build_trainer(case: Case):
    """A native trainer for ``case``; two calls give trainers with equal weights and generators."""
    backbone = backbones.tiny(case.backbone, seed=case.seed, **case.sizes)
    reward = ProjectionReward(backbone.latent_shape, seed=case.seed)
    return _TRAINERS[case.trainer](case.config, backbone, reward, RandomPrompts(backbone, NUM_PROMPTS, seed=case.seed))


def build_pair(case: Case):
    """The untransformed program and the Retain rewrite, each owning its own copy of the same model."""
    native = leancompile.optimize(build_trainer(case), schedule="native")
    retain = leancompile.optimize(build_trainer(case), schedule="retain")
    if retain.plan.schedule != "retain":
        raise RuntimeError(f"{case.name}: optimize did not choose retain:\n{retain.plan}")
    return native, retain


@dataclass
class Timing:
    wall: float
    cpu: float  # this process's CPU time: on one thread, what the wall time would be without other load


def timed_step(trainer, prompts) -> tuple[Timing, dict]:
    # Collect before the clock starts so that a collection of the previous step's garbage is not billed here.
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    stats = trainer.step(prompts)
    return Timing(time.perf_counter() - wall, time.process_time() - cpu), stats


def interleaved_times(native, retain, prompts, repetitions: int) -> tuple[list[Timing], list[Timing], dict]:
    """A/B alternation, so that load from other processes hits both programs alike."""
    native_times, retain_times, stats = [], [], {}
    for _ in range(repetitions):
        native_times.append(timed_step(native, prompts)[0])
        timing, stats = timed_step(retain, prompts)
        retain_times.append(timing)
    return native_times, retain_times, stats


def median(timings: list[Timing], kind: str) -> float:
    return statistics.median(getattr(t, kind) for t in timings)


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: every FLOP is billed to "Global" only."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class TotalFlopCounter(FlopCounterMode):
    """FlopCounterMode without the per-module breakdown. Its module tracker hooks every module call and fails on
    the compiled backbone, a GraphModule run inside an autograd.Function with grad off (outputs that require grad
    but have no grad_fn); the total needs no attribution."""

    def __init__(self):
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()


def step_flops(trainer, prompts) -> int:
    """FLOPs of one GRPO step (matmuls, attention and convolutions, forward and backward)."""
    with TotalFlopCounter() as counter:
        trainer.step(prompts)
    return counter.get_total_flops()


def max_rel_weight_diff(a, b) -> float:
    """The largest ``|a - b| / |a|`` (Frobenius norms) over the trainable tensors; inf if any is not finite."""
    worst = 0.0
    for x, y in zip(a.trainable, b.trainable, strict=True):
        x, y = x.detach().double(), y.detach().double()
        diff = float((x - y).norm() / x.norm().clamp_min(1e-30))
        # max() would drop a NaN (every comparison with it is false) and report a diverged run as equal.
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
    return worst


def timing_fields(native_times: list[Timing], retain_times: list[Timing]) -> dict:
    native, retain = median(native_times, "wall"), median(retain_times, "wall")
    native_cpu, retain_cpu = median(native_times, "cpu"), median(retain_times, "cpu")
    return {
        "speedup": native / retain,
        "native_seconds": native,
        "optimized_seconds": retain,
        "cpu_speedup": native_cpu / retain_cpu,
        "native_cpu_seconds": native_cpu,
        "optimized_cpu_seconds": retain_cpu,
        "native_times": [t.wall for t in native_times],
        "optimized_times": [t.wall for t in retain_times],
    }


def measure_case(case: Case, repetitions: int) -> dict:
    """One row of the results. Both trainers run the same sequence of steps (warm-up, timed, FLOP-counted), so
    their weights must agree at the end."""
    native, retain = build_pair(case)
    prompts = list(case.prompts)
    timed_step(native, prompts)
    timed_step(retain, prompts)  # compiles the partitioned backbone
    native_times, retain_times, stats = interleaved_times(native, retain, prompts, repetitions)
    native_flops, retain_flops = step_flops(native, prompts), step_flops(retain, prompts)
    row = {"backbone": case.backbone, "trainer": case.trainer, "schedule": "retain",
           **timing_fields(native_times, retain_times),
           "ideal_speedup": native_flops / retain_flops,
           "native_flops": native_flops,
           "optimized_flops": retain_flops,
           "retained_bytes": stats["retained_bytes"],
           "reused_micro_steps": stats["reused_micro_steps"],
           "recomputed_micro_steps": stats["recomputed_micro_steps"],
           "repetitions": repetitions,
           "max_rel_weight_diff": max_rel_weight_diff(native, retain),
           "parameters": sum(p.numel() for p in native.backbone.parameters()),
           "sizes": dict(case.sizes)}
    row["ratio"] = row["speedup"] / row["ideal_speedup"]
    return row
