"""What the loop examples share: their command line, and the module each trains (``transformer`` or ``model``)."""
from __future__ import annotations

import argparse


def trained_module(loop):
    """The module a loop example trains (wrapped by leancompile or not)."""
    return loop.model if hasattr(loop, "model") else loop.transformer


def run(loop_class, description: str, steps: int) -> None:
    """``[--native] [--steps N]``: run the loop, print its mean reward per 20 steps and, wrapped, its calls."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--native", action="store_true", help="run without leancompile")
    parser.add_argument("--steps", type=int, default=steps)
    args = parser.parse_args()
    loop = loop_class(use_leancompile=not args.native)
    means = [loop.step() for _ in range(args.steps)]
    for start in range(0, len(means), 20):
        window = means[start:start + 20]
        print(f"steps {start:>4}-{start + len(window) - 1:>4}: mean reward {sum(window) / len(window):.4f}")
    if not args.native:
        print("calls:", trained_module(loop).stats())
