"""bf16 equivalence on a FlowGRPO-FLUX-style loop, measured (benchmarks/bf16_equivalence.py runs it; ``python -m
benchmarks.bf16_equivalence --tiny`` prints these figures).

FlowGRPO's FLUX scripts in bf16 read the stored latents back as strided views of the stacked rollout trajectory
(``latents[:, j]``), which bf16 kernels round otherwise than the rollout's contiguous tensors: native's update does
not reproduce its own rollout, its first-step ratio ``exp(logp - logp_old)`` is off 1 by rounding and a clip range
of 1e-5 clips most samples. Laid out as the rollout (its contiguous tensors, the same batch) native reproduces it
bitwise here. Served calls return the rollout's own values: the ratio is exactly 1, as the objective defines it at
the first optimizer step, and the served gradient is the on-policy one to bf16 rounding of the backward, not
native's clipped one.

Figures on the tiny Flux (LoRA rank 4, 2 prompts x 4 samples, 4 steps trained; 2 cores, torch 2.13.0+cpu): native's
max abs(ratio - 1) 4.5e-4 (mean 8.3e-5), 91% of the (sample, step) ratios clipped; served and native laid out as the
rollout: 0 and 0%. Gradients: native against native laid out as the rollout, relative difference 0.81 and cosine
0.595 (native's own layout noise, through the samples it clips); served against native laid out as the rollout,
2.7e-3 and 0.999996; served against native, cosine 0.596. Wrapped with ``bitwise=True`` every update call is
served too, the ratio exactly 1, and the gradient is bitwise native's laid out as the rollout. On the CPU, float32 weights under bf16 autocast compute
bitwise what bf16 weights compute (autocast casts the weights to bf16, the LoRA adapters are float32 in both). The
bounds below keep a wide margin on those figures.
"""
import functools

import pytest
import torch

from benchmarks.bf16_equivalence import RUNS, Setup, measure


@functools.lru_cache(maxsize=None)
def _figures(weights: str) -> dict:
    figures = measure(Setup(weights=weights))
    print(f"\n{weights} weights:", {run: {k: v for k, v in figures[run].items() if k not in ("grad", "trajectory")}
                                     for run in RUNS},
          {k: v for k, v in figures.items() if "~" in k})
    return figures


def _check(figures: dict, setup: Setup = Setup()):
    native, contiguous = figures["native"], figures["contiguous"]
    # one rollout: the wrapped module's kept calls return native's bits
    assert all(torch.equal(native["trajectory"], figures[run]["trajectory"]) for run in RUNS)
    # every update call served, and on-policy exactly
    for run in ("served", "bitwise"):
        r = figures[run]
        assert r["served_calls"] == setup.num_steps and r["recomputed_calls"] == 0, (run, r)
        assert r["max_deviation"] == 0.0 and r["clipped"] == 0.0, (run, r)
    # bitwise=True serves the gradient native computes laid out as its rollout, bit for bit: not native's own
    assert torch.equal(figures["bitwise"]["grad"], contiguous["grad"])
    # native laid out as its rollout reproduces it; read through strided views it does not, and clips
    assert contiguous["max_deviation"] == 0.0
    assert native["max_deviation"] > 10 * setup.clip_range, native["max_deviation"]
    assert native["clipped"] >= 0.25, native["clipped"]
    # the served gradient is native-laid-out-as-the-rollout's to bf16 rounding of the backward...
    on_policy = figures["served~contiguous"]
    assert on_policy["relative"] < 0.02 and on_policy["cosine"] > 0.9999, on_policy
    # ...while native's own layout moves native's gradient far more (its clipped samples)...
    noise = figures["native~contiguous"]
    assert noise["relative"] > 10 * on_policy["relative"] and noise["cosine"] < 0.99, noise
    # ...and that, not the serving, is the served gradient's distance from native's
    assert abs(figures["served~native"]["cosine"] - noise["cosine"]) < 0.01, (figures["served~native"], noise)


@pytest.mark.fast
def test_bf16_weights_served_ratio_is_one_native_clips():
    _check(_figures("bf16"))


def test_float32_weights_under_bf16_autocast_compute_what_bf16_weights_compute():
    figures = _figures("fp32")
    _check(figures)
    for run in RUNS:
        assert torch.equal(figures[run]["grad"], _figures("bf16")[run]["grad"]), run
