"""``python -m benchmarks.compile_time [--model flux.1-dev] [--resolution 256] [--whole]``: how long compiling the
per-row program takes on a real model's architecture (meta weights, fake tensors: nothing is computed), per
transformer block (runtime.regional: one program per block structure) against the whole backbone's partition.

Compile time does not depend on the resolution (shapes are symbols of nothing here: fixed), so a small one keeps
the meta forward that records the blocks' calls quick. Full fine-tuning: every weight requires grad."""
from __future__ import annotations

import argparse
import time

import torch

from leancompile.backbones import real
from leancompile.backbones.plain import plain_copy
from leancompile.runtime.calls import Call
from leancompile.runtime.regional import structure
from leancompile.runtime.rowwise import RowwiseBackbone


def block_calls(backbone) -> dict[tuple, tuple]:
    """One recorded call (module, Call) per block structure, from one forward on the meta device."""
    calls, hooks = {}, []
    for _, stack in backbone.block_stacks():
        for block in stack:
            key = structure(block)

            def record(module, args, kwargs, key=key):
                calls.setdefault(key, (module, Call.of(args, kwargs)))
            hooks.append(block.register_forward_pre_hook(record, with_kwargs=True))
    x = torch.zeros((1, *backbone.latent_shape), device="meta", dtype=torch.bfloat16)
    cond = backbone.dummy_conditioning(1).to(device="meta")
    with torch.no_grad():
        backbone(x, torch.full((1,), 0.5, device="meta", dtype=torch.bfloat16), cond)
    for hook in hooks:
        hook.remove()
    return calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__)
    parser.add_argument("--model", default="flux.1-dev")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--whole", action="store_true", help="also compile the whole backbone's partition")
    args = parser.parse_args(argv)
    backbone = real(args.model, args.resolution)
    blocks = sum(len(stack) for _, stack in backbone.block_stacks())
    calls = block_calls(backbone)
    start = time.perf_counter()
    for block, call in calls.values():
        program = RowwiseBackbone(block, traced=plain_copy(block), input_grads=True)._partition(call)
        assert program.refusal is None, program.refusal
    per_block = time.perf_counter() - start
    print(f"{args.model}: {blocks} blocks, {len(calls)} block structure(s): per-block programs compile in "
          f"{per_block:.1f} s")
    if args.whole:
        x = torch.zeros((1, *backbone.latent_shape), device="meta", dtype=torch.bfloat16)
        cond = backbone.dummy_conditioning(1).to(device="meta")
        call = Call.of((x, torch.full((1,), 0.5, device="meta", dtype=torch.bfloat16), cond), {})
        start = time.perf_counter()
        RowwiseBackbone(backbone)._partition(call)
        print(f"{args.model}: the whole backbone's partition compiles in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
