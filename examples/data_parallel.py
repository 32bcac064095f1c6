"""Data-parallel GRPO on the digits task under torchrun, optimized by leancompile.

    torchrun --nproc-per-node 2 examples/data_parallel.py --parallel ddp --schedule auto
    torchrun --nproc-per-node 8 examples/data_parallel.py --parallel fsdp --same-prompt-groups   # GPUs: nccl

Each rank trains its own prompts (or, with ``--same-prompt-groups``, its share of every prompt's group); the
gradients are averaged across ranks once per optimizer step. GPUs use nccl and one device per rank; the CPU
uses gloo.
"""
import argparse
import os

import torch
import torch.distributed as dist

import leancompile
from leancompile.tasks import digits
from leancompile.tasks.rewards import DigitsClassifierReward
from leancompile.trainers import FlowGRPOConfig, FlowGRPOTrainer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--schedule", choices=["auto", "retain", "reweight", "native"], default="auto")
    parser.add_argument("--same-prompt-groups", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = digits.load_pretrained().to(device)
    config = FlowGRPOConfig(num_steps=6, timestep_fraction=0.5, group_size=8, train_batch_size=16,
                            guidance_scale=2.0, cfg_detach_uncond=True, lora_rank=8, learning_rate=3e-3,
                            parallel=args.parallel, same_prompt_groups=args.same_prompt_groups,
                            drop_zero_advantages=False, seed=0)
    trainer = FlowGRPOTrainer(config, model.backbone, DigitsClassifierReward(), model.encode,
                              uncond=model.encode([digits.NULL_CLASS]))
    fast = leancompile.optimize(trainer, schedule=args.schedule)
    if rank == 0:
        print(fast.plan)
    # The standard layout: each rank its own two digits; the same-prompt layout: every rank the same two.
    prompts = [3, 7] if args.same_prompt_groups else [(2 * rank) % 10, (2 * rank + 1) % 10]
    for _ in range(args.steps):
        stats = fast.step(prompts)
        if rank == 0:
            print(f"step {stats['step']}: reward {stats['reward_mean']:.3f} (rank 0), {stats['step_seconds']:.2f} s, "
                  f"{stats['gradient_syncs']} gradient sync(s), {stats['gradient_collectives']} collective(s) "
                  f"on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
