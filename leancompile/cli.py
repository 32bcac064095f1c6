"""The ``leancompile`` command line.

Importing this module (and ``leancompile --help``) loads neither diffusers nor peft: each command imports what it
needs when it runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .request import OPTIMIZE_SCHEDULES
from .backbones.factory import REAL_MODELS
from .backbones.families import FAMILIES
from .cost.sharding import SHARDINGS
from .schedules import SCHEDULES
from .trainers import TRAINERS

DESCRIPTION = """\
leancompile removes the redundant backbone forward of GRPO post-training for flow transformers: the update's
backbone calls are served from the rollout's, verified call by call, with native's gradient.
"leancompile COMMAND --help" describes each command's options.
"""

EPILOG = """\
examples:
  leancompile env
  leancompile plan --model flux.1-dev --device h100-80gb --resolution 720 --full --samples 1 --world-size 8
  leancompile plan --config path/to/transformer/config.json --resolution 512
  leancompile tiny-report --family flux --schedule reweight

In Python: model = leancompile.wrap(model) in your own loop, or leancompile.optimize(trainer) for the built-in
trainers (docs/wrapping.md, docs/trainers.md).
"""

def build_parser() -> argparse.ArgumentParser:
    from .cost.devices import DEVICES

    parser = argparse.ArgumentParser(prog="leancompile", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"leancompile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("env", help="versions of torch, diffusers, peft, TRL and accelerate; devices; what is supported",
                   description="Print the versions of the packages leancompile works with, the devices this "
                   "process sees, and what is supported (wrapped modules, trainers, schedules, data parallel).")

    demo = sub.add_parser("demo", help="GRPO fine-tuning of the digits model, native and optimized side by side",
                          description="FlowGRPO fine-tuning of the shipped digits model to draw a 3, the native "
                          "program and optimize(trainer, 'retain') interleaved step by step; writes metrics.json, "
                          "reward.png, samples-before.png and samples-after.png.")
    demo.add_argument("--grpo-steps", type=int, default=20, metavar="N",
                      help="GRPO steps (rollout, then update) per program (default: 20)")
    demo.add_argument("--out", default="demo-out", metavar="DIR", help="output folder (default: demo-out)")

    tiny = sub.add_parser("tiny-report", aliases=["explain"],
                          help="optimize a built-in trainer on a tiny random backbone, print its plan and write "
                          "its HTML report",
                          description="Build a built-in GRPO trainer on a tiny random backbone (seconds on a CPU), "
                          "optimize it, run one step, print its plan and pass history and write DIR/report.html "
                          "(the plan and a drawing of every graph). For your own trainer: print(fast.plan), "
                          "fast.explain() and leancompile.report.write_html_report(fast, path).")
    tiny.add_argument("--family", choices=tuple(FAMILIES), default="sd3",
                      help="backbone family of the tiny random model (default: sd3)")
    tiny.add_argument("--trainer", choices=tuple(TRAINERS), default="flowgrpo", help="GRPO algorithm (default: flowgrpo)")
    tiny.add_argument("--schedule", choices=OPTIMIZE_SCHEDULES, default="auto",
                      help="schedule passed to optimize(): auto (the planner's choice), native, or "
                      + "; ".join(f"{name} ({spec.summary})" for name, spec in SCHEDULES.items()) + " (default: auto)")
    _guidance_scale(tiny)
    tiny.add_argument("--out", default="tiny-report-out", metavar="DIR",
                      help="output folder (default: tiny-report-out)")

    plan = sub.add_parser("plan", help="predict memory and step time of native, each schedule and auto for a "
                          "real-size model on a named GPU (nothing is downloaded or allocated)",
                          description="Predict, for a real-size model on a named GPU, the memory of every "
                          "component and the step time of native, each schedule and the planner's choice (auto). "
                          "The model is built on the meta device from its config and profiled on fake tensors: "
                          "nothing is downloaded or allocated (a few seconds to about 25 s for FLUX.1-dev on 2 "
                          "cores). Defaults follow DanceGRPO. Needs diffusers and peft (leancompile[diffusers]).")
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", choices=REAL_MODELS, help="a shipped model config")
    model.add_argument("--config", metavar="PATH",
                       help="your own model: a diffusers config.json (as save_pretrained writes it, with "
                       "_class_name FluxTransformer2DModel, SD3Transformer2DModel or WanTransformer3DModel), or "
                       "the folder holding it")
    plan.add_argument("--device", "--gpu", dest="device", default="h100-80gb", metavar="NAME",
                      help=f"one of {', '.join(sorted(DEVICES))} (datasheet figures), or cpu or cuda for the live "
                      "device (default: h100-80gb)")
    plan.add_argument("--trainer", choices=tuple(TRAINERS), default="dancegrpo", help="GRPO algorithm (default: "
                      "dancegrpo)")
    plan.add_argument("--resolution", type=int, default=1024, metavar="PIXELS",
                      help="image side in pixels (default: 1024)")
    plan.add_argument("--frames", type=int, default=81, help="video length in frames, Wan only (default: 81)")
    plan.add_argument("--text-len", type=int, default=None, metavar="TOKENS",
                      help="text conditioning length in tokens (default: the shipped model's of the same family)")
    plan.add_argument("--denoising-steps", type=int, default=16, metavar="N",
                      help="denoising steps per sample (default: 16)")
    plan.add_argument("--timestep-fraction", type=float, default=0.6, metavar="F",
                      help="fraction of the denoising steps trained, in (0, 1] (default: 0.6)")
    plan.add_argument("--lora-rank", type=int, default=64, metavar="R", help="LoRA rank (default: 64)")
    plan.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    plan.add_argument("--micro-batch", type=int, default=1, metavar="N",
                      help="samples per rollout call and per update call (default: 1)")
    plan.add_argument("--samples", type=int, default=8, metavar="N",
                      help="samples per rank per GRPO step; the group spans the ranks (default: 8)")
    _guidance_scale(plan)
    plan.add_argument("--kl", type=float, default=0.0, metavar="BETA",
                      help="weight beta of the KL penalty to the reference model (default: 0)")
    plan.add_argument("--world-size", type=int, default=1, metavar="RANKS", help="data-parallel ranks (default: 1)")
    plan.add_argument("--sharding", choices=sorted(SHARDINGS), default="fsdp",
                      help="fsdp (FSDP2 fully_shard per block), fsdp1 (FullyShardedDataParallel FULL_SHARD per block), "
                           "fsdp1-grad-op (its SHARD_GRAD_OP), zero3 (DeepSpeed ZeRO-3) or ddp (default: fsdp)")
    plan.add_argument("--budget", type=float, default=None, metavar="GIB",
                      help="memory budget per rank in GiB (default: the device's memory less a 10%% margin)")
    plan.add_argument("--json", action="store_true", help="print JSON for scripts instead of the table")
    plan.add_argument("--plot", default=None, metavar="PNG",
                      help="also write a chart of memory by component against the budget (needs matplotlib)")
    return parser


def _guidance_scale(parser) -> None:
    parser.add_argument("--guidance-scale", type=float, default=1.0, metavar="SCALE",
                        help="classifier-free guidance scale; above 1 every call runs on the doubled batch "
                        "[uncond, cond] (default: 1, no guidance)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "env":
        return _env()
    if args.command == "plan":
        return _plan(args)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.main(args)
    if args.command in ("tiny-report", "explain"):
        return _tiny_report(args)
    return 2


def _env() -> int:
    import platform
    from importlib.metadata import PackageNotFoundError, version as installed

    import torch

    from .cost.devices import DEVICES

    def installed_version(name: str) -> str:
        try:
            return installed(name)
        except PackageNotFoundError:
            return "not installed"

    print(f"leancompile  {__version__}")
    print(f"python       {platform.python_version()} ({sys.executable})")
    for name in ("torch", "diffusers", "peft", "transformers", "trl", "accelerate"):
        print(f"{name:<13}{installed_version(name)}")
    print("\ndevices:")
    print(f"  cpu: {torch.get_num_threads()} torch threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i}: {props.name}, {props.total_memory / 2 ** 30:.1f} GiB (CUDA {torch.version.cuda})")
    else:
        print("  cuda: none available")
    print(f"  planned devices (leancompile plan --device): {', '.join(sorted(DEVICES))}, cpu, cuda")
    print("\nsupported:")
    print("  leancompile.wrap(module): any nn.Module whose output rows depend only on the same input rows "
          "(diffusers Flux, SD3, Wan transformers with or without peft LoRA; causal LMs)")
    print(f"  built-in trainers (optimize): {', '.join(tuple(TRAINERS))} on families {', '.join(FAMILIES)}")
    print(f"  schedules: {', '.join(OPTIMIZE_SCHEDULES)}; bitwise=True for native's bits (Retain)")
    print("  data parallel: DDP, FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel served per block, "
          "wrapped before or after it, FULL_SHARD or SHARD_GRAD_OP, MixedPrecision or not) tested on 2 gloo ranks; "
          "DeepSpeed ZeRO-3 served per block where the blocks are ZeRO-3 leaf modules; FSDP1's other strategies and "
          "CPU offload, and ZeRO-3 without leaf blocks, run natively with the reason; DeepSpeed ZeRO-2 served")
    print("  TRL GRPOTrainer: wrap(model) before the trainer (docs/trl.md); accelerate: served (docs/wrapping.md)")
    print("  CUDA: tests/test_cuda.py ran on one H200 (docs/results.md); no GPU timings measured")
    return 0


def _tiny_report(args) -> int:
    import torch

    from . import report
    from .tasks import synthetic

    if args.command == "explain":
        print("leancompile: 'explain' is now 'tiny-report'", file=sys.stderr)
    torch.set_num_threads(1)  # the backbone is tiny: intra-op threads cost more than they give
    trainer = synthetic.optimized_tiny_trainer(args.family, args.trainer, args.schedule, args.guidance_scale)
    trainer.step(list(synthetic.TINY_PROMPTS))  # builds the backbone's partition graphs
    print(trainer.explain())
    path = report.write_html_report(trainer, Path(args.out) / "report.html")
    print(f"report: {path}")
    return 0


def _plan(args) -> int:
    import json

    from .cost import devices, planner, scenario
    from .schedules import estimators

    name = args.model or args.config
    try:
        device = devices.get_device(args.device)
        s = scenario.model_scenario(name, trainer=args.trainer, resolution=args.resolution, frames=args.frames,
                                    steps=args.denoising_steps, timestep_fraction=args.timestep_fraction,
                                    lora_rank=None if args.full else args.lora_rank, micro_batch=args.micro_batch,
                                    samples=args.samples, guidance_scale=args.guidance_scale, beta=args.kl,
                                    world_size=args.world_size, sharding=args.sharding, text_len=args.text_len)
        budget = None if args.budget is None else int(args.budget * devices.GiB)
        plan = planner.plan(s, device, budget, estimators=estimators())
    except (ValueError, OSError) as error:
        print(f"leancompile plan: {error}", file=sys.stderr)
        return 2
    if args.plot:
        from .cost.chart import plot_plan

        plot_plan(plan, Path(args.plot), title=f"{name} on {device.name}")
    if args.json:
        print(json.dumps({**plan.to_json(), "model": name, "settings": {
            k: v for k, v in vars(args).items() if k not in ("command", "json", "plot")}}, indent=2))
    else:
        print(f"{name} ({args.trainer}, {'full' if args.full else f'LoRA r{args.lora_rank}'}, "
              f"{args.resolution}px, {s.profile.tokens} tokens/row, {args.samples} samples/rank, "
              f"world {args.world_size} {s.layout.label})")
        print(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
