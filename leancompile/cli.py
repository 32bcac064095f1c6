"""The ``leancompile`` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leancompile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO fine-tuning on the digits task; writes demo-out/")
    demo.add_argument("--out", default="demo-out", help="output folder (default: demo-out)")
    demo.add_argument("--steps", type=int, default=20, help="GRPO steps (default: 20)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
