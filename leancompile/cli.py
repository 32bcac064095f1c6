"""The ``leancompile`` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .api import REQUESTS
from .backbones.families import FAMILIES
from .schedules import SCHEDULES, estimators
from .trainers import TRAINERS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leancompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO fine-tuning on the digits task; writes demo-out/")
    demo.add_argument("--out", default="demo-out", help="output folder (default: demo-out)")
    demo.add_argument("--steps", type=int, default=20, help="GRPO steps (default: 20)")
    explain = sub.add_parser("explain", help="optimize a trainer on a tiny backbone, print its plan and write "
                             "explain-out/report.html")
    explain.add_argument("--backbone", choices=tuple(FAMILIES), default="sd3",
                         help="family of the tiny random backbone (default: sd3)")
    explain.add_argument("--trainer", choices=tuple(TRAINERS), default="flowgrpo",
                         help="GRPO algorithm (default: flowgrpo)")
    explain.add_argument("--schedule", choices=REQUESTS, default="auto",
                         help="schedule passed to optimize(): auto (the planner's choice), native, or "
                         + "; ".join(f"{name} ({spec.summary})" for name, spec in SCHEDULES.items())
                         + " (default: auto)")
    explain.add_argument("--cfg", action="store_true", help="train with classifier-free guidance")
    explain.add_argument("--out", default="explain-out", help="output folder (default: explain-out)")
    _plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.main(args)
    if args.command == "explain":
        return _explain(args)
    return 2


def _explain(args) -> int:
    import torch

    from . import report
    from .tasks import synthetic

    torch.set_num_threads(1)  # the backbone is tiny: intra-op threads cost more than they give
    trainer = synthetic.optimized_tiny_trainer(args.backbone, args.trainer, args.schedule, args.cfg)
    trainer.step(list(synthetic.TINY_PROMPTS))  # builds the backbone's partition graphs
    print(trainer.explain())
    path = report.write_html_report(trainer, Path(args.out) / "report.html")
    print(f"report: {path}")
    return 0


def _plan_parser(sub) -> None:
    from .backbones.factory import REAL_MODELS
    from .cost.devices import DEVICES

    plan = sub.add_parser("plan", help="predict memory and speedup of native, each schedule and auto for a "
                          "real-size model on a named GPU (nothing is downloaded or allocated)")
    plan.add_argument("--model", choices=REAL_MODELS, required=True)
    plan.add_argument("--gpu", default="h100-80gb", help=f"one of {', '.join(sorted(DEVICES))}, cpu or cuda (the "
                      "live device) (default: h100-80gb)")
    plan.add_argument("--trainer", choices=tuple(TRAINERS), default="dancegrpo")
    plan.add_argument("--resolution", type=int, default=1024, help="pixels per side (default: 1024)")
    plan.add_argument("--frames", type=int, default=81, help="video frames, Wan only (default: 81)")
    plan.add_argument("--steps", type=int, default=16, help="denoising steps (default: 16)")
    plan.add_argument("--timestep-fraction", type=float, default=0.6, help="fraction of steps trained (default: 0.6)")
    plan.add_argument("--lora-rank", type=int, default=64, help="LoRA rank (default: 64)")
    plan.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    plan.add_argument("--micro-batch", type=int, default=1, help="samples per rollout and update call (default: 1)")
    plan.add_argument("--samples", type=int, default=8, help="samples per rank per GRPO step (default: 8)")
    plan.add_argument("--cfg", type=float, default=1.0, help="guidance scale; > 1 doubles every call (default: 1)")
    plan.add_argument("--kl", type=float, default=0.0, help="KL weight beta (default: 0)")
    plan.add_argument("--world-size", type=int, default=1, help="ranks (default: 1)")
    plan.add_argument("--sharding", choices=("fsdp", "ddp"), default="fsdp")
    plan.add_argument("--budget", type=float, default=None, help="memory budget in GiB (default: the device's "
                      "memory less a 10%% margin)")
    plan.add_argument("--json", action="store_true", help="print JSON for scripts")
    plan.add_argument("--plot", default=None, metavar="PNG", help="write a chart of memory by component")


def _plan(args) -> int:
    import json

    from .cost import devices, planner, scenario

    try:
        device = devices.get_device(args.gpu)
        s = scenario.model_scenario(args.model, trainer=args.trainer, resolution=args.resolution,
                                    frames=args.frames, steps=args.steps, timestep_fraction=args.timestep_fraction,
                                    lora_rank=None if args.full else args.lora_rank, micro_batch=args.micro_batch,
                                    samples=args.samples, guidance_scale=args.cfg, beta=args.kl,
                                    world_size=args.world_size, sharding=args.sharding)
        budget = None if args.budget is None else int(args.budget * devices.GiB)
        plan = planner.plan(s, device, budget, estimators=estimators())
    except ValueError as error:
        print(f"leancompile plan: {error}", file=sys.stderr)
        return 2
    if args.plot:
        from .cost.chart import plot_plan

        plot_plan(plan, Path(args.plot), title=f"{args.model} on {device.name}")
    if args.json:
        print(json.dumps({**plan.to_json(), "model": args.model, "settings": {
            k: v for k, v in vars(args).items() if k not in ("command", "json", "plot")}}, indent=2))
    else:
        print(f"{args.model} ({args.trainer}, {'full' if args.full else f'LoRA r{args.lora_rank}'}, "
              f"{args.resolution}px, {s.profile.tokens} tokens/row, {args.samples} samples/rank, "
              f"world {args.world_size} {args.sharding})")
        print(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
