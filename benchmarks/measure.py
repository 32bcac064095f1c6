"""Measure one case: interleaved step times, FLOPs per step, held bytes and weight agreement per schedule."""
from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import leancompile
from leancompile import backbones
from leancompile.cost.planner import describe_steps
from leancompile.cost.workload import FlopCounter
from leancompile.plan import Action
from leancompile.runtime.calls import Call
from leancompile.runtime.engine import no_stats
from leancompile.runtime.identity import StateReader, row_keys
from leancompile.tasks.synthetic import RandomPrompts
from leancompile.trainers import trainer_class

from .cases import Case
from .task import NUM_PROMPTS, ProjectionReward


def build_trainer(case: Case):
    """A native trainer for ``case``; two calls give trainers with equal weights and generators."""
    backbone = backbones.tiny(case.backbone, seed=case.seed, **case.sizes).to(case.device)
    reward = ProjectionReward(backbone.latent_shape, seed=case.seed)
    uncond = None
    prompts = RandomPrompts(backbone, NUM_PROMPTS, seed=case.seed)
    if case.config.use_cfg:
        uncond = prompts.uncond
    return trainer_class(case.algorithm)(case.config, backbone, reward, prompts, uncond=uncond)


def build_programs(case: Case, schedules: tuple[str, ...]) -> dict:
    """The native trainer as it is and each optimized schedule, each owning its own copy of the same model; a
    schedule the plan refuses here (e.g. Reweight where the rollout's attention kernel differs from the update's)
    is left out, and the plan's reason printed."""
    programs = {"native": build_trainer(case)}
    for schedule in schedules:
        bitwise = schedule == "bitwise"  # Retain keeping native's bits: kept eager graphs, served whole calls only
        optimized = leancompile.optimize(build_trainer(case), schedule="retain" if bitwise else schedule,
                                         bitwise=bitwise)
        if schedule not in ("auto", "bitwise") and optimized.plan.schedule != schedule:
            print(f"{case.name}: {schedule} not measured: {optimized.plan.choice}", file=sys.stderr, flush=True)
            continue
        programs[schedule] = optimized
    return programs


@dataclass
class Timing:
    wall: float
    cpu: float  # this process's CPU time: on one thread, what the wall time would be without other load
    peak: int | None = None  # CUDA: the allocator's peak during the step


def timed_step(trainer, prompts) -> tuple[Timing, dict]:
    # Collect before the clock starts so that a collection of the previous step's garbage is not billed here.
    gc.collect()
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall, cpu = time.perf_counter(), time.process_time()
    stats = trainer.step(prompts)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return Timing(time.perf_counter() - wall, time.process_time() - cpu, peak), stats


def interleaved_times(programs: dict, prompts, repetitions: int) -> tuple[dict, dict]:
    """Round-robin alternation, so that load from other processes hits every program alike; every other round in
    reverse order, so that no program always follows the same one (whose caches and allocations it inherits)."""
    times = {name: [] for name in programs}
    stats = {}
    for round_ in range(repetitions):
        for name, trainer in (reversed if round_ % 2 else iter)(list(programs.items())):
            timing, stats[name] = timed_step(trainer, prompts)
            times[name].append(timing)
    return times, stats


def median(timings: list[Timing], kind: str) -> float:
    return statistics.median(getattr(t, kind) for t in timings)


def counted_step(trainer, prompts) -> tuple[Timing, int]:
    """A step and its FLOPs (matmuls, attention and convolutions, forward and backward): torch's FLOP formulas, the
    CPU's attention kernels included, counted per operator as the step runs; operators a compiler traces in the
    step are not counted. The counter slows the step: it is not a timed one."""
    with FlopCounter() as counter:
        timing, _ = timed_step(trainer, prompts)
    return timing, counter.total


def redundant_step(trainer, prompts) -> tuple[int, int]:
    """Native's step counted: its FLOPs, and the FLOPs of the backbone forwards in it that repeat an earlier call's
    rows (each row's inputs bitwise equal and the module in the same state: weights' versions, adapters, autocast,
    training flags), by the reuse engine's own identity test; under activation checkpointing a repeated forward
    with grad runs twice. What no schedule can remove is the rest: the most any schedule can gain is
    ``total / (total - redundant)``, the method's limit (a program's own FLOPs set its ideal instead)."""
    backbone = trainer.backbone
    reader = StateReader(backbone)
    seen: set = set()
    redundant, starts = 0.0, []
    checkpointing = bool(getattr(trainer.config, "gradient_checkpointing", False))

    def before(module, args, kwargs):
        starts.append(counter.total)

    def after(module, args, kwargs, output):
        nonlocal redundant
        flops = counter.total - starts.pop()
        call = Call.of(args, kwargs)
        if call.refusal is not None:
            return
        state = reader.read(call)  # a frozen value: equal states hash equal
        rows = [(state, digest) for digest in row_keys(call.row_inputs)]
        repeated = sum(row in seen for row in rows)
        seen.update(rows)
        redundant += flops * repeated / call.batch * (1 + (checkpointing and torch.is_grad_enabled()))

    hooks = [backbone.register_forward_pre_hook(before, with_kwargs=True),
             backbone.register_forward_hook(after, with_kwargs=True)]
    try:
        with FlopCounter() as counter:
            timed_step(trainer, prompts)
    finally:
        for hook in hooks:
            hook.remove()
    return counter.total, int(redundant)


def max_rel_weight_diff(a, b) -> float:
    """The largest ``|a - b| / |a|`` (Frobenius norms) over the trainable tensors; inf if any is not finite."""
    worst = 0.0
    for x, y in zip(a.trainable, b.trainable, strict=True):
        x, y = x.detach().double(), y.detach().double()
        diff = float((x - y).norm() / x.norm().clamp_min(1e-30))
        # max() would drop a NaN (every comparison with it is false) and report a diverged run as equal.
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
    return worst


def paired_speedup(native_times: list[Timing], optimized_times: list[Timing], kind: str) -> float:
    """The median over rounds of native's time over the optimized program's in the same round: the two ran
    back to back, so a slow spell of the machine (another process, a lower clock) cancels out of each ratio."""
    return statistics.median(getattr(n, kind) / getattr(o, kind)
                             for n, o in zip(native_times, optimized_times, strict=True))


def timing_fields(native_times: list[Timing], optimized_times: list[Timing]) -> dict:
    native, optimized = median(native_times, "wall"), median(optimized_times, "wall")
    native_cpu, optimized_cpu = median(native_times, "cpu"), median(optimized_times, "cpu")
    return {
        "speedup": paired_speedup(native_times, optimized_times, "wall"),
        "native_seconds": native,
        "optimized_seconds": optimized,
        "cpu_speedup": paired_speedup(native_times, optimized_times, "cpu"),
        "native_cpu_seconds": native_cpu,
        "optimized_cpu_seconds": optimized_cpu,
        "native_times": [t.wall for t in native_times],
        "optimized_times": [t.wall for t in optimized_times],
        # measured where the device has an allocator to ask (CUDA); None on the CPU
        "native_peak_bytes": max((t.peak for t in native_times if t.peak is not None), default=None),
        "peak_bytes": max((t.peak for t in optimized_times if t.peak is not None), default=None),
    }


def same_program(auto, schedule: str) -> bool:
    """Whether ``auto`` compiled to ``schedule``'s program: the same runtime, every trained step served alike."""
    return auto.plan.schedule == schedule and all(a.label in (schedule, "no-grad") for a in auto.plan.steps)


def measure_case(case: Case, repetitions: int, schedules: tuple[str, ...] = ("retain", "reweight", "auto"),
                 min_seconds: float = 0.0) -> list[dict]:
    """One row per schedule. Every program runs the same sequence of steps (two warm-up steps, more while auto's
    trial runs, the last FLOP-counted, then the timed rounds), so their weights must agree with the native program's at the end. The
    planner's predictions come from an auto compilation of the same trainer (on this CPU, for this step's
    samples). At least ``repetitions`` rounds are timed, more where native's steps are short, until they add up to
    about ``min_seconds`` of native time."""
    programs = build_programs(case, schedules)
    schedules = tuple(s for s in schedules if s in programs)
    cost = (programs["auto"] if "auto" in programs else leancompile.optimize(build_trainer(case))).plan.cost
    prompts = list(case.prompts)
    # The first step compiles and traces. auto tries its program against native over whole steps before it settles
    # (runtime.auto_trial): every program takes those steps too, so that their weights compare.
    warm_up = {name: timed_step(trainer, prompts) for name, trainer in programs.items()}
    while "auto" in warm_up and warm_up["auto"][1]["trying"]:
        warm_up = {name: timed_step(trainer, prompts) for name, trainer in programs.items()}
    # Where auto settled on exactly a single schedule's program, or on native, timing it again would only measure
    # noise: its row reports that program's measurement.
    timed_as = {name: name for name in schedules}
    if "auto" in programs:
        timed_as["auto"] = "native" if programs["auto"]._engine is None else next(
            (s for s in schedules if s != "auto" and same_program(programs["auto"], s)), "auto")
    timed = {name: programs[name] for name in ("native", *schedules) if timed_as.get(name, name) == name}
    # Not the first step: that one can skip work every later step does (while LoRA's B is zero the policy is the
    # KL reference, so Reweight's KL gradient is exactly zero and its backward is skipped), and the paths it
    # skipped compile in the second.
    flops = {name: counted_step(trainer, prompts)[1] for name, trainer in timed.items() if name != "native"}
    flops["native"], redundant = redundant_step(programs["native"], prompts)
    # A short step's ratio spreads more between rounds; a time budget evens the rows' precision.
    repetitions = max(repetitions, math.ceil(min_seconds / warm_up["native"][0].wall))
    times, stats = interleaved_times(timed, prompts, repetitions)
    native = programs["native"]
    rows = []
    for schedule in schedules:
        source = timed_as[schedule]
        # auto settled on native: its row reads the native trainer's step, which has no engine's statistics
        optimized, s, plan = timed[source], {**no_stats(), **stats[source]}, programs[schedule].plan
        row = {"backbone": case.backbone, "trainer": case.trainer, "tuning": case.tuning, "schedule": schedule,
               "runs": plan.schedule, "timed_as": source,
               # auto: the program it runs and its action per trained step
               "plan": describe_steps([a for a in plan.steps if a.kind is not Action.NO_GRAD]) if schedule == "auto"
               else "",
               # the planner has no model of bitwise Retain's reuse (it depends on the update's batching)
               "predicted_speedup": cost.speedup(schedule) if cost is not None and schedule != "bitwise" else None,
               **timing_fields(times["native"], times[source]),
               "ideal_speedup": flops["native"] / flops[source],
               "limit_speedup": flops["native"] / max(flops["native"] - redundant, 1),
               "native_flops": flops["native"],
               "optimized_flops": flops[source],
               # what the schedule holds from the rollout to the update: activations (retain), gradient buffers and
               # the backbone's kept inputs and outputs (reweight)
               "held_bytes": s["retained_bytes"] + s["buffer_bytes"],
               "offloaded_bytes": s.get("offloaded_bytes", 0),
               "served_calls": s["served_calls"],
               "recomputed_calls": s["recomputed_calls"],
               # the run-time verification's share of the last timed step (state reads, row digests, lookups)
               "check_fraction": s.get("check_seconds", 0.0) / times[source][-1].wall,
               "repetitions": repetitions,
               "max_rel_weight_diff": max_rel_weight_diff(native, optimized),
               "parameters": sum(p.numel() for p in native.backbone.parameters()),
               "sizes": dict(case.sizes)}
        row["ratio"] = row["speedup"] / row["ideal_speedup"]
        row["limit_ratio"] = row["speedup"] / row["limit_speedup"]
        rows.append(row)
    singles = [s for s in schedules if s in ("retain", "reweight")]
    fastest = max((r for r in rows if r["schedule"] != "bitwise"), key=lambda r: r["speedup"], default=None)
    for row in rows:
        if row["schedule"] == "bitwise" and fastest is not None:
            # What keeping native's bits costs against the fastest non-bitwise program, paired round by round.
            row["bitwise_vs_fastest"] = paired_speedup(times[timed_as[fastest["schedule"]]], times["bitwise"], "wall")
        if row["schedule"] == "auto" and singles:
            # Auto against the single schedule it is slowest against, paired round by round like the speedups: a
            # quotient of two speedups would compound both pairings' noise. The floor is 0.97 (3% slower).
            row["auto_vs_best"] = min(paired_speedup(times[timed_as[s]], times[timed_as["auto"]], "wall")
                                      for s in singles)
    return rows
