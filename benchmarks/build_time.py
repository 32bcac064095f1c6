"""``python -m benchmarks.build_time``: how long the shipped real-size models take to build on the meta device and
to run one forward there (shapes only), against the bounds the planner's users wait for.

Wall-clock checks live here, not in the test suite: on shared cores they measure the neighbours too.
"""
from __future__ import annotations

import sys
import time

import torch

from leancompile.backbones import REAL_MODELS, real

BUILD_SECONDS = 10  # per model, on the meta device
FORWARD_SECONDS = 20  # one forward on meta tensors
FORWARD_SIZES = {"flux.1-dev": dict(resolution=1024), "sd3.5-medium": dict(resolution=512),
                 "wan2.1-1.3b": dict(resolution=(256, 256), frames=9)}


def main() -> int:
    slow = []
    for name in REAL_MODELS:
        start = time.perf_counter()
        backbone = real(name)
        built = time.perf_counter() - start
        line = f"{name:<14} built in {built:6.2f} s (bound {BUILD_SECONDS} s)"
        slow += [f"{name} build"] if built > BUILD_SECONDS else []
        if name in FORWARD_SIZES:
            backbone = real(name, **FORWARD_SIZES[name])
            x = torch.empty((1, *backbone.latent_shape), device="meta", dtype=torch.bfloat16)
            sigma = torch.empty(1, device="meta", dtype=torch.bfloat16)
            start = time.perf_counter()
            with torch.no_grad():
                backbone(x, sigma, backbone.dummy_conditioning(1))
            forward = time.perf_counter() - start
            line += f", forward on meta {forward:6.2f} s (bound {FORWARD_SECONDS} s)"
            slow += [f"{name} forward"] if forward > FORWARD_SECONDS else []
        print(line)
    if slow:
        print(f"over the bound: {', '.join(slow)}")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
