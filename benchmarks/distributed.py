"""The data-parallel rows: native, Retain, Reweight and auto under DDP and FSDP2 on ``--world-size`` gloo processes.

    python -m benchmarks.distributed [--world-size 2] [--parallel ddp fsdp] [--repetitions 5] [--out bench-out]

Each rank trains its own prompts (the standard layout) on one CPU thread; every program runs the same steps,
interleaved, and the gradients are averaged across the ranks once per optimizer step. A step's time is rank 0's
(the ranks wait for each other in the gradient sync). Rows carry the gradient syncs and collectives per step, the
weight all-gathers per step (FSDP2) and whether the step ran per transformer block.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from .cases import cases
from .measure import build_programs, counted_step, interleaved_times, max_rel_weight_diff, timed_step, timing_fields
from . import report
from .report import machine_line, markdown_table

SCHEDULES = ("retain", "reweight", "auto")
_SHOWN = ("backbone", "trainer", "tuning", "schedule", "native_seconds", "optimized_seconds", "speedup", "ideal_speedup",
          "ratio", "max_rel_weight_diff", "repetitions")
COLUMNS = tuple(c for c in report.COLUMNS if c[1] in _SHOWN) + (
    ("engine", "parallel", "{}"), ("ranks", "world_size", "{}"), ("gradient syncs/step", "gradient_syncs", "{}"),
    ("collectives/step", "gradient_collectives", "{}"), ("native's", "native_gradient_collectives", "{}"),
    ("weight gathers/step", "weight_gathers", "{}"), ("native's gathers", "native_weight_gathers", "{}"),
    ("per block", "per_block", "{}"))
TRAINERS = ("flowgrpo", "dancegrpo")


def data_parallel_case(case, parallel: str = "ddp"):
    """``case`` with each rank training its own prompts; every rank runs the same number of optimizer steps."""
    config = dataclasses.replace(case.config, parallel=parallel, drop_zero_advantages=False)
    return dataclasses.replace(case, config=config)


def rank_prompts(case, rank: int) -> list[int]:
    return [p + rank * len(case.prompts) for p in case.prompts]


def _worker(rank, world, port, selected, repetitions, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = []
    for case in selected:
        programs = build_programs(case, SCHEDULES)
        prompts = rank_prompts(case, rank)
        for trainer in programs.values():
            timed_step(trainer, prompts)  # compiles
        flops = {name: counted_step(trainer, prompts)[1] for name, trainer in programs.items()}  # as measure_case
        times, stats = interleaved_times(programs, prompts, repetitions)
        native = programs["native"]
        for schedule in (s for s in SCHEDULES if s in programs):
            s = stats[schedule]
            row = {"backbone": case.backbone, "trainer": case.trainer, "tuning": case.tuning, "schedule": schedule,
                   "runs": programs[schedule].plan.schedule, "parallel": case.config.parallel, "world_size": world,
                   **timing_fields(times["native"], times[schedule]),
                   "ideal_speedup": flops["native"] / flops[schedule],
                   "gradient_syncs": s["gradient_syncs"], "gradient_collectives": s["gradient_collectives"],
                   "optimizer_steps": s["optimizer_steps"],
                   "native_gradient_collectives": stats["native"]["gradient_collectives"],
                   "weight_gathers": s["weight_gathers"], "native_weight_gathers": stats["native"]["weight_gathers"],
                   "per_block": "yes" if getattr(programs[schedule].sync, "per_block", False) else "no",
                   "served_calls": s["served_calls"], "repetitions": repetitions,
                   "max_rel_weight_diff": max_rel_weight_diff(native, programs[schedule])}
            row["ratio"] = row["speedup"] / row["ideal_speedup"]
            rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(selected, world: int, repetitions: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        torch.multiprocessing.spawn(_worker, args=(world, port, selected, repetitions, out), nprocs=world)
        return json.loads(Path(out).read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--families", nargs="+", default=["flux"])
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS))
    parser.add_argument("--parallel", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as each rank runs
    selected = [data_parallel_case(c, parallel) for parallel in args.parallel
                for c in cases(families=args.families, trainers=args.trainers, tunings=("lora",))]
    rows = measure(selected, args.world_size, args.repetitions)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed.json").write_text(json.dumps(rows, indent=1))
    table = markdown_table(rows, COLUMNS)
    text = f"{machine_line()}\n\n{args.world_size} gloo processes, one thread each\n\n{table}\n"
    (args.out / "distributed.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
