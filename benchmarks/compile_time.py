"""``python -m benchmarks.compile_time [--model flux.1-dev] [--resolution 256] [--whole]``: how long compiling the
per-row program takes on a real model's architecture (meta weights, fake tensors: nothing is computed), per
transformer block (runtime.regional: one program per block structure) against the whole backbone's partition.

Compile time does not depend on the resolution (shapes are symbols of nothing here: fixed), so a small one keeps
the meta forward that records the blocks' calls quick. Full fine-tuning: every weight requires grad.

``python -m benchmarks.compile_time --loop [--layers 2 4]``: the first step of the FlowGRPO SD3 loop
(examples/flowgrpo_sd3.py at the benchmark's sizes) wrapped, at each depth, as one program for the whole call and
per block (``per_block=True``: identical blocks share one program), in a fresh process with an empty program cache
and again in a second fresh process reading the first's (runtime.program_cache): the compile's seconds, split into
the one-row partitions (AOTAutograd's joint trace, the partition, its passes) and the vmapped traces, against the
native first step's seconds."""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
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


def first_step(layers: int, per_block: bool) -> dict:
    """In this process: the FlowGRPO SD3 loop's first step natively and wrapped (``per_block``: one program per
    block structure, runtime.regional), at ``layers`` blocks; the compile's seconds and where they went."""
    import types

    import leancompile
    from examples import flowgrpo_sd3

    from .cases import backbone_sizes

    torch.set_num_threads(1)
    spent = {"partition": 0.0, "traces": 0.0}

    def timed(method, part):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return run

    # each stage by itself: the partition is compiled before the calls that trace its rows
    RowwiseBackbone._partition = timed(RowwiseBackbone._partition, "partition")
    RowwiseBackbone._traced = timed(RowwiseBackbone._traced, "traces")
    flowgrpo_sd3.leancompile = types.SimpleNamespace(wrap=functools.partial(leancompile.wrap, per_block=per_block))
    config = flowgrpo_sd3.Config(sizes=tuple({**backbone_sizes("sd3"), "num_layers": layers}.items()))
    seconds = {}
    for key, use in (("native", False), ("wrapped", True)):
        loop = flowgrpo_sd3.Loop(config, use_leancompile=use)
        start = time.perf_counter()
        loop.step()
        seconds[key] = time.perf_counter() - start
    stats = loop.transformer.stats()
    return {"layers": layers, "per_block": per_block, "native_first_step": seconds["native"],
            "wrapped_first_step": seconds["wrapped"], "compile": stats["compile_seconds"],
            "served_calls": stats["served_calls"], **spent}


def loop_table(layer_counts: list[int]) -> str:
    """Each depth's first step, the whole call and per block, in a process with an empty program cache, then in a
    second reading it."""
    lines = ["| layers | program | process | native first step s | wrapped first step s | compile s | partitions s | "
             "traces s | calls served |", "|---|---|---|---|---|---|---|---|---|"]
    for layers, per_block in itertools.product(layer_counts, (False, True)):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "LEANCOMPILE_CACHE_DIR": cache, "LEANCOMPILE_CACHE": "1"}
            for process in ("first (empty cache)", "second (the first's cache)"):
                command = [sys.executable, "-m", "benchmarks.compile_time", "--first-step", str(layers)]
                out = subprocess.run(command + ["--per-block"] * per_block, env=env, capture_output=True, text=True,
                                     check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                lines.append(f"| {layers} | {'per block' if per_block else 'whole call'} | {process} | "
                             f"{r['native_first_step']:.2f} | {r['wrapped_first_step']:.2f} "
                             f"| {r['compile']:.2f} | {r['partition']:.2f} | {r['traces']:.2f} | "
                             f"{r['served_calls']} |")
                print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux.1-dev")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--whole", action="store_true", help="also compile the whole backbone's partition")
    parser.add_argument("--loop", action="store_true", help="the FlowGRPO SD3 loop's first step, twice per depth")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="--loop's depths (default: 2 4)")
    parser.add_argument("--first-step", type=int, default=None, help=argparse.SUPPRESS)  # one process of --loop
    parser.add_argument("--per-block", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_step is not None:
        print(json.dumps(first_step(args.first_step, args.per_block)))
        return
    if args.loop:
        print(loop_table(args.layers))
        return
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
