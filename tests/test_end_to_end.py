"""A short training run of the digits task: native and auto follow the same trajectory (the benchmark runs the
same comparison over 20 steps)."""
from benchmarks.equivalence import train_side_by_side


def test_native_and_auto_train_the_digits_model_identically():
    run = train_side_by_side(steps=4)
    assert run["auto_runs"] in ("retain", "reweight") and run["served_calls"] == 4 * 4
    assert run["max_reward_diff"] <= 1e-8
    assert run["weight_rel_error"] <= 1e-8
