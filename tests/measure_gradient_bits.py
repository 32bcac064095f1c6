"""How far a served gradient is from native's, per precision (the figures of docs/equivalence-bits.md).

For each backbone and precision a wrapped module keeps one rollout call of R rows (no grad) and serves the same call
with grad; its parameters' gradient (Retain: the per-row backward summed over the rows; Reweight: per-row gradients
combined) is compared with native's gradient of the same call and loss. For scale, the same distance is given
between native's gradient of the call and native's gradients of its rows one at a time, summed: how much the
rounding of the backward's reductions moves a gradient when only the grouping of the rows changes.

    PYTHONPATH=$PWD python tests/measure_gradient_bits.py            # the gradients
    PYTHONPATH=$PWD python tests/measure_gradient_bits.py --digits   # the 20-step digits run's rewards
"""
from __future__ import annotations

import copy
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import leancompile
from leancompile import backbones

ROWS = 3


def _case(name: str):
    """``(module, args, kwargs, output)`` of one call of ``ROWS`` rows."""
    generator = torch.Generator().manual_seed(2)
    if name == "llama":
        torch.manual_seed(3)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
        ids = torch.randint(0, 32, (ROWS, 10), generator=generator)
        return model, (), dict(input_ids=ids, use_cache=False), lambda out: out.logits
    backbone = backbones.tiny(name, seed=1)
    x = torch.randn(ROWS, *backbone.latent_shape, generator=generator)
    sigma = torch.rand(ROWS, generator=generator)
    return backbone, (x, sigma, backbone.dummy_conditioning(ROWS, generator=generator)), {}, lambda out: out


def _gradient(module, args, kwargs, output, cotangent, autocast) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    with autocast():
        out = output(module(*args, **kwargs))
    (out.float() * cotangent).sum().backward()
    return torch.cat([p.grad.double().flatten() for p in module.parameters() if p.grad is not None])


def _rows_one_at_a_time(module, args, kwargs, output, cotangent, autocast) -> torch.Tensor:
    pick = lambda value, i: (value[i:i + 1] if isinstance(value, torch.Tensor) and value.shape[:1] == (ROWS,)
                             else value.index(torch.tensor([i])) if hasattr(value, "index") else value)
    total = 0
    for i in range(ROWS):
        total = total + _gradient(module, tuple(pick(a, i) for a in args), {k: pick(v, i) for k, v in kwargs.items()},
                                  output, cotangent[i:i + 1], autocast)
    return total


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def measure(name: str, precision: str, schedule: str) -> dict:
    dtype = {"float32": None, "bf16": torch.bfloat16}[precision]
    autocast = lambda: torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    module, args, kwargs, output = _case(name)
    module.train(False)
    native = copy.deepcopy(module)
    with torch.no_grad(), autocast():
        shape = output(native(*args, **kwargs)).shape
    cotangent = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    expected = _gradient(native, args, kwargs, output, cotangent, autocast)
    regrouped = _rows_one_at_a_time(native, args, kwargs, output, cotangent, autocast)
    wrapped = leancompile.wrap(module, schedule=schedule)
    with torch.no_grad(), autocast():
        wrapped(*args, **kwargs)  # the rollout's call: kept
    if schedule == "reweight":
        def head(advantage):
            with autocast():
                out = output(wrapped(*args, **kwargs))
            return advantage * (out.float() * cotangent).sum()
        wrapped.provisional(head)
    served = _gradient(wrapped, args, kwargs, output, cotangent, autocast)
    stats = wrapped.stats()
    assert stats["served_calls"] == 1, stats
    return {"backbone": name, "precision": precision, "schedule": schedule, "served": _distance(served, expected),
            "rows one at a time": _distance(regrouped, expected)}


def main() -> None:
    torch.set_num_threads(1)
    if "--digits" in sys.argv:
        print("| precision | GRPO steps | auto runs | micro-steps reused | first steps with native's rewards bit for bit "
              "| max reward difference | weight rel. error |")
        print("|---|---|---|---|---|---|---|")
        for precision in ("float64", "float32", "bf16"):
            r = digits_run(20, precision)
            first = (r["bitwise_reward_steps"] + [False]).index(False)  # the steps before the first that differs
            print(f"| {precision} | 20 | {r['schedule']} | {r['served_calls']} | {first} | {r['max_reward_diff']:.1e} "
                  f"| {r['weight_rel_error']:.1e} |", flush=True)
        return
    print("| backbone | precision | schedule | served vs native | native's rows one at a time vs native |")
    print("|---|---|---|---|---|")
    for precision in ("float32", "bf16"):
        for name in ("flux", "sd3", "wan", "llama"):
            for schedule in ("retain", "reweight"):
                r = measure(name, precision, schedule)
                print(f"| {r['backbone']} | {r['precision']} | {r['schedule']} | {r['served']:.1e} | "
                      f"{r['rows one at a time']:.1e} |", flush=True)


def digits_run(steps: int, precision: str) -> dict:
    """The digits run of ``benchmarks.equivalence`` (native and auto side by side): per step, whether the rollout's
    rewards are native's bit for bit; the largest difference of a step's mean reward; the calls served; the weights'
    distance at the end, relative to native's total update."""
    from benchmarks.equivalence import PROMPTS, _trainer, _weights
    from leancompile import optimize

    native, auto = _trainer(precision), optimize(_trainer(precision))
    start = _weights(native)
    equal, differences, served = [], [], 0
    for _ in range(steps):
        n, a = native.step(PROMPTS), auto.step(PROMPTS)
        equal.append(bool(torch.equal(native.last_rollout.rewards, auto.last_rollout.rewards)))
        differences.append(abs(n["reward_mean"] - a["reward_mean"]))
        served += a["served_calls"]
    update = _weights(native) - start
    return {"precision": precision, "schedule": auto.plan.schedule, "bitwise_reward_steps": equal,
            "served_calls": served, "max_reward_diff": max(differences),
            "weight_rel_error": float((_weights(native) - _weights(auto)).norm() / update.norm())}

if __name__ == "__main__":
    main()
