"""``python -m benchmarks.test_size [--backbones wan sd3] [--repetitions 9]``: native, Retain and auto side by side
at the test suite's size (``cases.TEST_SIZE_CONFIG``, the tiny backbones), where the per-row program's fixed costs
decide: each program's speedup over native (the median over rounds of the paired ratio, after one warm-up step
that compiles), auto's plan and whether its run-time check fell back. The floor: auto at 0.97x of native or
faster."""
from __future__ import annotations

import argparse

from .cases import FAMILIES, test_size_cases
from .jobs import single_threaded
from .measure import build_programs, interleaved_times, paired_speedup, timed_step

FLOOR = 0.97


def measure(case, repetitions: int) -> dict:
    programs = build_programs(case, ("retain", "auto"))
    prompts = list(case.prompts)
    first = {name: timed_step(trainer, prompts) for name, trainer in programs.items()}  # compiles
    times, stats = interleaved_times(programs, prompts, repetitions)
    auto = programs["auto"]
    return {"backbone": case.backbone, "first_step_seconds": {n: t.wall for n, (t, _) in first.items()},
            "native_seconds": min(t.wall for t in times["native"]),
            "speedup": {name: paired_speedup(times["native"], times[name], "wall") for name in programs
                        if name != "native"},
            "auto_runs": str(auto.plan.schedule),
            "auto_fallback": first["auto"][1]["stopped"] or stats["auto"]["stopped"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.test_size", description=__doc__)
    parser.add_argument("--backbones", nargs="+", choices=FAMILIES, default=["wan", "sd3"])
    parser.add_argument("--repetitions", type=int, default=9, help="timed rounds after the warm-up (default 9)")
    args = parser.parse_args(argv)
    if args.repetitions < 1:
        parser.error(f"--repetitions must be >= 1; got {args.repetitions}")
    single_threaded()
    print("| backbone | native step | retain | auto | auto runs | first step: native / retain / auto | "
          "auto fell back |")
    print("|---|---|---|---|---|---|---|")
    for case in test_size_cases(args.backbones):
        row = measure(case, args.repetitions)
        first = " / ".join(f"{row['first_step_seconds'][n]:.2f} s" for n in ("native", "retain", "auto"))
        speedup = row["speedup"]
        print(f"| {row['backbone']} | {row['native_seconds'] * 1e3:.0f} ms | {speedup['retain']:.2f}x | "
              f"{speedup['auto']:.2f}x{'' if speedup['auto'] >= FLOOR else ' (below the floor)'} | "
              f"{row['auto_runs']} | {first} | {row['auto_fallback'] or 'no'} |", flush=True)


if __name__ == "__main__":
    main()
