"""The drop-in loops (``examples/``) natively and with ``leancompile.wrap``: step times side by side, FLOPs, and
how far from 1 the importance ratio of the update's first micro-step is in each."""
from __future__ import annotations

import dataclasses
import math

import torch

from examples import dancegrpo_flux, flowgrpo_sd3, grpo_llm
from examples.loop_cli import trained_module

from .cases import backbone_sizes
from leancompile.runtime.auto import AUTO_FLOOR

from .measure import counted_step, interleaved_times, max_rel_weight_diff, timed_step, timing_fields
from .public_loops import DanceGRPOWanLoop, FlowGRPOFluxLoop, Setup, WanSetup
from .trl import TrlConfig, TrlLoop

# Each loop at the benchmark's sizes (wider than the examples' defaults, see cases.py); the LLM runs its rollout's
# old log-probabilities over 128 sequences at once and its update in micro-batches of 32.
LOOPS = {
    "llm/grpo": (grpo_llm.Loop, grpo_llm.Config(hidden=256, layers=4, micro_batch=32)),
    # TRL's GRPOTrainer on a Qwen2 of the same width: 64 completions per generation, micro-batches of 32
    "llm/trl": (TrlLoop, TrlConfig(hidden=256, layers=4, micro_batch=32)),
    "sd3/flowgrpo": (flowgrpo_sd3.Loop, flowgrpo_sd3.Config(sizes=tuple(backbone_sizes("sd3").items()))),
    "flux/dancegrpo": (dancegrpo_flux.Loop, dancegrpo_flux.Config(sizes=tuple(backbone_sizes("flux").items()))),
}
# Each loop under Reweight too (it hands its loss to ``wrapped.provisional``), and under auto (Retain while the
# per-row program is measured no slower than native, else native).
LOOPS.update({f"{name}/{schedule}": (loop, dataclasses.replace(config, schedule=schedule))
              for name, (loop, config) in list(LOOPS.items()) for schedule in ("reweight", "auto")})
# Public scripts' call patterns in bf16 (benchmarks/public_loops.py), each wrapped by its one line alone: FlowGRPO's
# FLUX scripts (3 of 6 steps trained, two optimizer steps per rollout), DanceGRPO's Wan script (one sample a call
# with its CFG rows, one optimizer step per rollout), Flow-Factory's pattern (1 of 10 steps trained, two optimizer
# steps, shuffled micro-batches of two). Under Retain and auto.
PUBLIC_LOOPS = {
    "flux/flowgrpo-bf16": (FlowGRPOFluxLoop, Setup(sizes=tuple(backbone_sizes("flux").items()), num_steps=6,
                                                   train_steps=(0, 1, 2), optimizer_steps=2, shuffle=True,
                                                   clip_range=1e-4)),
    "wan/dancegrpo-bf16": (DanceGRPOWanLoop, WanSetup(sizes=tuple(backbone_sizes("wan").items()))),
    "flux/flow-factory": (FlowGRPOFluxLoop, Setup(sizes=tuple(backbone_sizes("flux").items()), num_steps=10,
                                                  train_steps=(4,), optimizer_steps=2, micro_batch=2, shuffle=True,
                                                  clip_range=1e-4)),
}
LOOPS.update(PUBLIC_LOOPS)
LOOPS.update({f"{name}/auto": (loop, dataclasses.replace(config, schedule="auto"))
              for name, (loop, config) in PUBLIC_LOOPS.items()})
QUICK_LOOPS = ("llm/grpo", "llm/trl")


def _on(device: str, name: str, config):
    """A loop's config on ``device``, at the benchmark's GPU sizes there (see cases.py)."""
    if device != "cuda":
        return config
    backbone = name.split("/")[0]
    wider = ({"hidden": 1024} if backbone == "llm"
             else {"sizes": tuple(backbone_sizes(backbone, device=device).items())})
    return dataclasses.replace(config, device=device, **wider)


class _Program:
    """A loop seen as the benchmark's programs are: ``step(prompts)`` and ``trainable``."""

    def __init__(self, loop):
        self.loop = loop
        self.module = trained_module(loop)
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.device = self.trainable[0].device
        self.cuda = self.device.type == "cuda"
        self.random = self._generators()  # its own stream of torch's generators (``generate`` draws on the device)

    def _generators(self) -> tuple:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def step(self, _prompts) -> dict:
        torch.set_rng_state(self.random[0])
        if self.cuda:
            torch.cuda.set_rng_state(self.random[1], self.device)
        self.loop.step()
        self.random = self._generators()
        return self.module.stats() if hasattr(self.module, "stats") else {}


def measure_loop(name: str, repetitions: int, device: str = "cpu", min_seconds: float = 0.0) -> dict:
    """One row: the loop natively and wrapped, stepped in alternation after three warm-up steps each (the last
    counts the FLOPs; under auto, after its trial too); at least ``repetitions`` rounds, more where native's steps
    are short, until they add up to about ``min_seconds`` of native time (as the cases' rows)."""
    loop_class, config = LOOPS[name]
    config = _on(device, name, config)
    programs = {"native": _Program(loop_class(config, use_leancompile=False)),
                "wrapped": _Program(loop_class(config, use_leancompile=True))}
    first = {key: program.step(None) for key, program in programs.items()}  # compiles, traces
    stats = {key: program.step(None) for key, program in programs.items()}
    # auto's trial alternates native and program cycles until its verdict (runtime.auto_trial): timed as the loop
    # runs then, and not under the FLOP counter's dispatch mode, which slows the program's many small operators
    # more than native's; both loops take as many steps, so that their weights compare
    while any(s.get("trying") for s in stats.values()):
        stats = {key: program.step(None) for key, program in programs.items()}
    flops = {key: counted_step(program, None)[1] for key, program in programs.items()}
    probe = {key: timed_step(program, None)[0] for key, program in programs.items()}  # both: their weights compare
    repetitions = max(repetitions, math.ceil(min_seconds / probe["native"].wall))
    times, stats = interleaved_times(programs, None, repetitions)
    backbone, trainer = name.split("/")[:2]
    wrapped = stats["wrapped"]
    every = sum(1 for _ in programs["native"].module.parameters())
    row = {"backbone": backbone, "trainer": trainer,
           "tuning": "full" if len(programs["native"].trainable) == every else "lora",
           "schedule": f"wrap ({config.schedule})", **timing_fields(times["native"], times["wrapped"]),
           "ideal_speedup": flops["native"] / flops["wrapped"], "native_flops": flops["native"],
           "optimized_flops": flops["wrapped"],
           "held_bytes": wrapped["retained_bytes"] + wrapped["buffer_bytes"],
           "served_calls": wrapped["served_calls"], "recomputed_calls": wrapped["recomputed_calls"],
           "compile_seconds": first["wrapped"]["compile_seconds"], "stopped": wrapped["stopped"],
           "check_fraction": wrapped["check_seconds"] / times["wrapped"][-1].wall,
           "repetitions": repetitions,
           "max_rel_weight_diff": max_rel_weight_diff(programs["native"], programs["wrapped"])}
    row["ratio"] = row["speedup"] / row["ideal_speedup"]
    return row


def measure_loop_runs(name: str, repetitions: int, device: str = "cpu", runs: int = 1,
                      min_seconds: float = 0.0) -> dict:
    """The loop measured ``runs`` times, each from fresh loops: the median run's row, with every run's speedup and
    in how many of them the wrapped loop was at least ``AUTO_FLOOR`` of native's speed (auto's floor)."""
    rows = sorted((measure_loop(name, repetitions, device, min_seconds) for _ in range(runs)),
                  key=lambda r: r["speedup"])
    speedups = [r["speedup"] for r in rows]
    return {**rows[len(rows) // 2], "speedups": speedups, "floor_held": sum(x >= AUTO_FLOOR for x in speedups)}


def on_policy(precision: str, device: str = "cpu") -> dict:
    """The LLM loop's first micro-step: its importance ratio natively (the update's micro-batch of 32 rows against
    old log-probabilities computed over all 128 at once) and wrapped (served from that very call)."""
    config = dataclasses.replace(_on(device, "llm/grpo", LOOPS["llm/grpo"][1]), dtype=torch.float32,
                                 autocast=torch.bfloat16 if precision == "bf16" else None)
    row = {"precision": precision, "device": device, "rollout_rows": config.prompts * config.group,
           "micro_batch": config.micro_batch}
    for key, use in (("native", False), ("wrapped", True)):
        loop = grpo_llm.Loop(config, use_leancompile=use)
        loop.step()
        ratio = loop.ratios[0].double()
        row[f"{key}_max_deviation"] = float((ratio - 1).abs().max())
        row[f"{key}_clipped"] = float(((ratio - 1).abs() > config.clip).double().mean())
    return row


def loops_markdown(rows: list[dict]) -> str:
    lines = ["| loop | native s | wrapped s | speedup | runs: speedups (at least 0.97x) | ideal (FLOPs) | "
             "measured/ideal | calls served | checks | first step's compile s | max rel weight diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = lambda r: (f"{', '.join(f'{x:.2f}' for x in r['speedups'])} ({r['floor_held']} of {len(r['speedups'])})"
                      if "speedups" in r else "-")
    lines += [f"| {r['backbone']}/{r['trainer']} ({r['tuning']}), {r['schedule']} | {r['native_seconds']:.3f} | "
              f"{r['optimized_seconds']:.3f} | {r['speedup']:.2f}x | {runs(r)} | {r['ideal_speedup']:.2f}x | "
              f"{r['ratio']:.2f} | "
              f"{r['served_calls']} of {r['served_calls'] + r['recomputed_calls']}"
              f"{' (stopped)' if r['stopped'] else ''} | {r['check_fraction']:.1%} | {r['compile_seconds']:.1f} | "
              f"{r['max_rel_weight_diff']:.1e} |" for r in rows]
    return "\n".join(lines)


def on_policy_markdown(rows: list[dict]) -> str:
    lines = ["| precision | rollout call rows | micro-batch | native max abs(ratio - 1) | native clipped | "
             "wrapped max abs(ratio - 1) | wrapped clipped |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['rollout_rows']} | {r['micro_batch']} | {r['native_max_deviation']:.1e} | "
              f"{r['native_clipped']:.1%} | {r['wrapped_max_deviation']:.1e} | {r['wrapped_clipped']:.1%} |"
              for r in rows]
    return "\n".join(lines)
