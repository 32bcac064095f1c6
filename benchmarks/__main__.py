"""``python -m benchmarks [--grid | --full] [--out DIR]``: Retain, Reweight and auto against the native program on
tiny Flux, SD3 and Wan under three schedules of the originals, with LoRA and full fine-tuning."""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from .cases import FAMILIES, QUICK_PAIRS, TRAINERS, TUNINGS, cases
from .equivalence import train_side_by_side
from .jobs import run_tasks, single_threaded
from .loops import LOOPS, QUICK_LOOPS, loops_markdown, measure_loop_runs, on_policy, on_policy_markdown
from .measure import measure_case
from .report import equivalence_markdown, machine_line, markdown_table, write_results

SCHEDULES = ("retain", "reweight", "auto", "bitwise")  # bitwise: Retain with optimize(..., bitwise=True)

QUICK_REPETITIONS = 5
FULL_REPETITIONS = 7
MIN_NATIVE_SECONDS = 6.0  # short steps get more rounds, up to about this much native time per row group


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--grid", action="store_true",
                       help="every backbone under every schedule (default: each backbone once and each schedule "
                            "once: " + ", ".join("/".join(pair) for pair in QUICK_PAIRS) + ")")
    scope.add_argument("--full", action="store_true",
                       help="the grid with larger latents, more repetitions and full fine-tuning")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out)")
    parser.add_argument("--repetitions", type=int, default=None,
                        help=f"timed steps per program at least (default {QUICK_REPETITIONS}, {FULL_REPETITIONS} with "
                             "--full)")
    parser.add_argument("--min-seconds", type=float, default=MIN_NATIVE_SECONDS,
                        help="more rounds where native's steps are short, until they add up to about this many "
                             f"seconds (default {MIN_NATIVE_SECONDS:g}; 0: exactly --repetitions)")
    parser.add_argument("--backbones", nargs="+", choices=FAMILIES, default=None,
                        help="these backbones under the chosen schedules (any of them: the grid over both lists)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=None,
                        help="these schedules of the originals, on the chosen backbones")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                        help="bf16: autocast around the backbone, float32 weights (default: float32)")
    parser.add_argument("--loops", nargs="*", choices=tuple(LOOPS), default=None,
                        help="the drop-in loops to time with leancompile.wrap (default: " + ", ".join(QUICK_LOOPS)
                             + "; all with --grid or --full; none: --loops with no name)")
    parser.add_argument("--loops-only", action="store_true",
                        help="time the loops alone: no backbone cases (with --equivalence-steps 0, nothing else)")
    parser.add_argument("--runs", type=int, default=1,
                        help="measure each loop this many times (auto's floor is checked in every run; default 1)")
    parser.add_argument("--equivalence-steps", type=int, default=20,
                        help="GRPO steps of the native-vs-auto training run on digits, float64 and bf16 (0: skip)")
    parser.add_argument("--tunings", nargs="+", choices=TUNINGS, default=None,
                        help="lora and/or full (default: lora; both with --full)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases measured at once, each in its own single-threaded process (default 1: the "
                             "other cases' steps slow a measured program unevenly, so more jobs finish sooner with "
                             "noisier ratios)")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda; got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.repetitions is not None and args.repetitions < 1:
        parser.error(f"--repetitions must be >= 1; got {args.repetitions}")
    if not args.min_seconds >= 0:
        parser.error(f"--min-seconds must be >= 0; got {args.min_seconds}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1; got {args.runs}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    if args.jobs > 1 and args.device == "cuda":
        parser.error("--jobs: cases on one GPU would share it and time each other; use --jobs 1 with --device cuda")
    return args


def selected_cases(args: argparse.Namespace) -> list:
    """Quick mode's pairs, or the grid over the chosen backbones and schedules."""
    grid = args.grid or args.full or args.backbones is not None or args.trainers is not None
    return cases(full=args.full, families=args.backbones or FAMILIES, trainers=args.trainers or TRAINERS,
                 tunings=args.tunings or (list(TUNINGS) if args.full else ["lora"]), device=args.device,
                 precision=args.precision, pairs=None if grid else QUICK_PAIRS)


def progress(row: dict, seconds: float) -> str:
    return (f"{row['backbone']}/{row['trainer']}/{row['tuning']}/{row['schedule']}: speedup {row['speedup']:.2f}x, ideal {row['ideal_speedup']:.2f}x, "
            f"ratio {row['ratio']:.2f} ({seconds:.0f} s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    single_threaded()
    repetitions = args.repetitions or (FULL_REPETITIONS if args.full else QUICK_REPETITIONS)
    start = time.perf_counter()
    measured = [] if args.loops_only else selected_cases(args)
    tasks = [(measure_case, case, repetitions, tuple(args.schedules), args.min_seconds) for case in measured]
    loops = args.loops if args.loops is not None else (list(LOOPS) if args.grid or args.full else list(QUICK_LOOPS))
    tasks += [(measure_loop_runs, name, repetitions, args.device, args.runs, args.min_seconds) for name in loops]
    on_policy_rows = any(name.startswith("llm/") for name in loops)  # the LLM loop's first micro-step's ratios
    tasks += [(on_policy, precision, args.device) for precision in (("float32", "bf16") if on_policy_rows else ())]
    if args.equivalence_steps > 0:
        tasks += [(train_side_by_side, args.equivalence_steps, precision) for precision in ("float64", "bf16")]
        tasks += [(train_side_by_side, args.equivalence_steps, precision, True) for precision in ("float32", "bf16")]
    results, interrupted = [None] * len(tasks), False
    try:
        for i, result, seconds in run_tasks(tasks, args.jobs):
            results[i] = result
            for row in result if i < len(measured) else ():
                print(progress(row, seconds), file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # e.g. a time limit (benchmarks/gpu.sh): keep what was measured
        print("interrupted: writing the rows measured so far", file=sys.stderr, flush=True)
        interrupted = True
    ends = list(itertools.accumulate((len(measured), len(loops), 2 if on_policy_rows else 0)))
    done = lambda part: [r for r in part if r is not None]
    rows = [row for case_rows in done(results[:ends[0]]) for row in case_rows]
    loop_rows, policy_rows = done(results[ends[0]:ends[1]]), done(results[ends[1]:ends[2]])
    equivalence = done(results[ends[2]:])
    machine = machine_line(args.jobs)
    json_path, md_path = write_results(rows, args.out, machine, equivalence, loop_rows, policy_rows)
    print(markdown_table(rows))
    if loop_rows:
        print(loops_markdown(loop_rows))
    if policy_rows:
        print(on_policy_markdown(policy_rows))
    if equivalence:
        print(equivalence_markdown(equivalence))
    print(machine)
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - start:.0f} s")
    return 130 if interrupted else 0  # as a shell reports an interrupted command


if __name__ == "__main__":
    sys.exit(main())
