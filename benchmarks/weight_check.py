"""``python -m benchmarks.weight_check``: what verifying the weights costs per answer, at the benchmark's sizes.

Every served call (and every served value) compares the digest of the weights' values now with the one its kept call
was made with (:mod:`leancompile.runtime.digest`). Per backbone of the quick benchmark (widened tiny Flux, SD3, Wan
with LoRA rank 4, 4 rows a call, float32), measured in one process: the digest's seconds (median of 15), a served
update call's seconds (its forward and backward, median of 7, each after a kept rollout call of new rows), and the
digest as a fraction of the served call; then the digest on a GPU, stated from bytes and bandwidth (eager
operations: ``digest.TRAFFIC`` bytes moved per byte of weights), for these backbones and for FLUX.1-dev's 11.9 B
bf16 parameters, whole and per rank under FSDP2 on 8 GPUs.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model

import leancompile
from leancompile import backbones
from leancompile.cost.devices import get_device
from leancompile.runtime.digest import TRAFFIC

from .cases import FAMILIES, backbone_sizes

ROWS = 4
GPU = "h100-80gb"
FLUX_DEV_BYTES = 11.9e9 * 2  # FLUX.1-dev's parameters in bf16


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(family: str) -> dict:
    base = backbones.tiny(family, seed=0, **backbone_sizes(family))
    model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=4, target_modules=base.lora_target_modules()))
    base.model = leancompile.wrap(model)
    # a step after each update: the next rollout's calls are kept (a rollout begins once the weights change)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    sigma = torch.full((ROWS,), 0.7)
    cond = base.dummy_conditioning(ROWS, generator)

    def served() -> None:
        x = torch.randn((ROWS, *base.latent_shape), generator=generator)
        with torch.no_grad():
            base(x, sigma, cond)
        start = time.perf_counter()
        base(x, sigma, cond).square().mean().backward()
        served.seconds.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()

    served.seconds = []
    for _ in range(8):  # the first compiles
        served()
    stats = model.stats()
    assert stats["served_calls"] == 8, stats
    reader = model.engine.reader
    digest_seconds = _median_seconds(reader.digest, 15)
    weight_bytes = sum(t.numel() * t.element_size() for _, t in reader.digested)
    call = statistics.median(served.seconds[1:])
    return {"family": family, "weight_bytes": weight_bytes, "digest_seconds": digest_seconds,
            "served_seconds": call, "fraction": digest_seconds / call}


def main() -> int:
    torch.set_num_threads(1)
    bandwidth = get_device(GPU).bandwidth
    print(f"| backbone | weights MiB | digest ms | served call ms | digest / served call | on an {GPU} (ms) |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        row = measure(family)
        gpu = TRAFFIC["cuda"] * row["weight_bytes"] / bandwidth
        print(f"| {family} | {row['weight_bytes'] / 2**20:.1f} | {row['digest_seconds'] * 1e3:.2f} | "
              f"{row['served_seconds'] * 1e3:.1f} | {row['fraction']:.1%} | {gpu * 1e3:.3f} |")
    whole = TRAFFIC["cuda"] * FLUX_DEV_BYTES / bandwidth
    print(f"\nFLUX.1-dev (bf16) on an {GPU}: {whole * 1e3:.0f} ms a digest of every weight, {whole / 8 * 1e3:.0f} ms "
          "per rank under FSDP2 on 8 GPUs (each block's own shard)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
