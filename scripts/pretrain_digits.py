"""Pretrain the digits SD3 transformer with rectified flow and ship it as a float16 checkpoint.

Trains the backbone and the class embedding on scikit-learn's 8x8 digits, then evaluates
10-step Euler samples with and without classifier-free guidance using the digits classifier
reward. Writes ``leancompile/data/digits_sd3.safetensors`` and ``digits_sd3.json``.

    .venv/bin/python scripts/pretrain_digits.py            # 4-5 minutes on 2 idle CPU cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leancompile.tasks.digits import (  # noqa: E402
    CHECKPOINT_PATH,
    DIGITS_CONFIG,
    LATENT_SHAPE,
    NULL_CLASS,
    NUM_CLASSES,
    TEXT_SHAPE,
    load_digit_images,
)
from leancompile.tasks.rewards import DigitsClassifierReward  # noqa: E402


def velocity(model, embed: nn.Embedding, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Same call convention as leancompile.backbones' sd3 Backbone, so the weights drop straight in.
    emb = embed(labels)
    return model(
        hidden_states=x, encoder_hidden_states=emb[:, None, :], pooled_projections=emb, timestep=sigma * 1000.0
    ).sample


@torch.no_grad()
def euler_sample(model, embed, labels: torch.Tensor, steps: int, guidance: float, gen: torch.Generator) -> torch.Tensor:
    n = labels.shape[0]
    x = torch.randn((n, *LATENT_SHAPE), generator=gen)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    both = torch.cat([labels, torch.full_like(labels, NULL_CLASS)])
    for i in range(steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        if guidance != 1.0:
            v_c, v_u = velocity(model, embed, torch.cat([x, x]), torch.full((2 * n,), s), both).chunk(2)
            v = v_u + guidance * (v_c - v_u)
        else:
            v = velocity(model, embed, x, torch.full((n,), s), labels)
        x = x + (s_next - s) * v
    return x


def evaluate(model, embed, per_class: int, steps: int, guidance: float, seed: int) -> dict:
    reward = DigitsClassifierReward()
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_class)
    gen = torch.Generator().manual_seed(seed)
    x = euler_sample(model, embed, labels, steps, guidance, gen)
    feats = ((x.clamp(-1, 1).reshape(len(x), 64) + 1.0) * 8.0 / 16.0).numpy()
    pred = torch.from_numpy(reward.classifier.predict(feats))
    r = reward(x, labels)
    return {
        "guidance": guidance,
        "steps": steps,
        "samples": len(labels),
        "accuracy": float((pred == labels).float().mean()),
        "mean_reward": float(r.mean()),
        "per_class_accuracy": [float((pred[labels == k] == k).float().mean()) for k in range(NUM_CLASSES)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--label-dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-per-class", type=int, default=100)
    ap.add_argument("--out", type=Path, default=CHECKPOINT_PATH)
    args = ap.parse_args()

    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    model = SD3Transformer2DModel(**DIGITS_CONFIG)
    embed = nn.Embedding(NUM_CLASSES + 1, TEXT_SHAPE[1])
    params = list(model.parameters()) + list(embed.parameters())
    n_params = sum(p.numel() for p in params)
    print(f"parameters: {n_params:,}", flush=True)

    data, targets = load_digit_images()
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        # Linear warmup then cosine decay to zero: stable start, settled weights at the end.
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.time()
    running = 0.0
    for step in range(args.steps):
        idx = torch.randint(0, len(data), (args.batch,), generator=gen)
        x0, labels = data[idx], targets[idx].clone()
        # Label dropout trains the null class that classifier-free guidance subtracts.
        drop = torch.rand(args.batch, generator=gen) < args.label_dropout
        labels[drop] = NULL_CLASS
        # Logit-normal sigma concentrates training on mid noise levels, where the flow is hardest.
        sigma = torch.sigmoid(torch.randn(args.batch, generator=gen))
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        xs = (1.0 - s) * x0 + s * noise
        loss = (velocity(model, embed, xs, sigma, labels) - (noise - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {running:.4f}  lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.0f}s", flush=True)
    train_seconds = time.time() - t0

    # Store float16 (halves the file) and evaluate exactly what ships: the float16-rounded weights.
    state = {f"model.{k}": v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    state["class_embed.weight"] = embed.weight.detach().to(torch.float16).contiguous()
    model.load_state_dict({k[len("model."):]: v.float() for k, v in state.items() if k.startswith("model.")})
    embed.weight.data.copy_(state["class_embed.weight"].float())
    model.eval()

    t1 = time.time()
    metrics = {
        "cfg2": evaluate(model, embed, args.eval_per_class, 10, 2.0, args.seed + 1),
        "cfg1": evaluate(model, embed, args.eval_per_class, 10, 1.0, args.seed + 1),
    }
    eval_seconds = time.time() - t1
    for name, m in metrics.items():
        print(f"{name}: accuracy {m['accuracy']:.3f}  mean reward {m['mean_reward']:.3f}", flush=True)

    settings = {
        "family": "sd3",
        "config": DIGITS_CONFIG,
        "class_embedding": [NUM_CLASSES + 1, TEXT_SHAPE[1]],
        "null_class": NULL_CLASS,
        "parameters": n_params,
        "objective": "rectified flow, x_sigma = (1 - sigma) x0 + sigma noise, target v = noise - x0",
        "sigma_sampling": "logit-normal (0, 1)",
        "timestep": "sigma * 1000",
        "steps": args.steps,
        "batch": args.batch,
        "optimizer": "AdamW(weight_decay=0.01), grad clip 1.0",
        "lr": args.lr,
        "schedule": f"linear warmup {args.warmup} steps, cosine to 0",
        "label_dropout": args.label_dropout,
        "seed": args.seed,
        "threads": args.threads,
        "data": "sklearn.datasets.load_digits, x / 8 - 1",
        "dtype": "float16",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "family": "sd3", "config": json.dumps(DIGITS_CONFIG), "null_class": str(NULL_CLASS),
            "steps": str(args.steps), "seed": str(args.seed)}
    save_file(state, str(args.out), metadata=meta)
    size = os.path.getsize(args.out)
    info = {
        "settings": settings,
        "metrics": metrics,
        "final_loss": running,
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "cpu_cores": os.cpu_count(),
        "checkpoint_bytes": size,
        "torch": torch.__version__,
    }
    args.out.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) in {train_seconds:.0f}s training", flush=True)


if __name__ == "__main__":
    main()
