"""A short training run of the digits task: native and auto follow the same trajectory (the benchmark runs the
same comparison over 20 steps)."""
import pytest

from benchmarks.equivalence import train_side_by_side


def test_native_and_auto_train_the_digits_model_identically():
    run = train_side_by_side(steps=4)
    assert run["auto_runs"] in ("retain", "reweight") and run["served_calls"] == 4 * 4
    assert run["max_reward_diff"] <= 1e-8
    assert run["weight_rel_error"] <= 1e-8


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_bitwise_auto_trains_the_digits_model_bit_for_bit(precision):
    """8 GRPO steps at a batch of one (the benchmark runs 20): every step's rewards and weights are native's bit for
    bit, and every update call is served from the rollout."""
    run = train_side_by_side(steps=8, precision=precision, bitwise=True)
    assert run["auto_runs"] == "retain" and run["served_calls"] == 8 * 16
    assert run["bitwise_steps"] == 8
