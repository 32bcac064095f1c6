"""The ``leancompile`` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leancompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO fine-tuning on the digits task; writes demo-out/")
    demo.add_argument("--out", default="demo-out", help="output folder (default: demo-out)")
    demo.add_argument("--steps", type=int, default=20, help="GRPO steps (default: 20)")
    explain = sub.add_parser("explain", help="optimize a trainer on a tiny backbone, print its plan and write "
                             "explain-out/report.html")
    explain.add_argument("--backbone", choices=("flux", "sd3", "wan"), default="sd3",
                         help="family of the tiny random backbone (default: sd3)")
    explain.add_argument("--trainer", choices=("flowgrpo", "dancegrpo"), default="flowgrpo",
                         help="GRPO algorithm (default: flowgrpo)")
    explain.add_argument("--schedule", choices=("auto", "retain", "reweight", "native"), default="auto",
                         help="schedule passed to optimize() (default: auto)")
    explain.add_argument("--cfg", action="store_true", help="train with classifier-free guidance")
    explain.add_argument("--out", default="explain-out", help="output folder (default: explain-out)")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
