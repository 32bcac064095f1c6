"""A short training run of the digits task: native and auto follow the same trajectory (the benchmark runs the
same comparison over 20 steps)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is a top-level folder

from benchmarks.equivalence import train_side_by_side  # noqa: E402


def test_native_and_auto_train_the_digits_model_identically():
    run = train_side_by_side(steps=4)
    assert run["auto_runs"] in ("retain", "reweight") and run["reused_micro_steps"] == 4 * 4
    assert run["max_reward_diff"] <= 1e-8
    assert run["weight_rel_error"] <= 1e-8
