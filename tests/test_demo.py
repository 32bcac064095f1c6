import json

from leancompile import cli


def test_demo_writes_metrics_curve_and_grids(tmp_path):
    assert cli.main(["demo", "--grpo-steps", "2", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["schedules"].keys() == {"native", "retain"}
    native, retain = metrics["schedules"]["native"], metrics["schedules"]["retain"]
    assert [r["step"] for r in native] == [r["step"] for r in retain] == [1, 2]
    assert all(0 <= r["reward_mean"] <= 1 and r["step_seconds"] > 0 for r in native + retain)
    # same seed, same rollout: the first step's rewards agree to float32 rounding (Retain's rollout runs its trained
    # steps through the per-row program, whose kernels round differently from the batched eager ones)
    assert abs(native[0]["reward_mean"] - retain[0]["reward_mean"]) <= 1e-6
    # The judge scores every step's rollout and the grids, before training and after it per schedule.
    assert all(0 <= r["judge_mean"] <= 1 and r["kl"] >= 0 for r in native + retain)
    assert metrics["grid_after"].keys() == {"native", "retain"}
    for grid in (metrics["grid_before"], *metrics["grid_after"].values()):
        assert grid.keys() == {"reward", "judge", "judge_accuracy"}
        assert all(0 <= v <= 1 for v in grid.values())
    # Before training the samples are a mix of digits: neither classifier finds the target in most of them.
    assert metrics["grid_before"]["reward"] < 0.5 and metrics["grid_before"]["judge_accuracy"] < 0.5
    assert metrics["config"]["beta"] > 0
    for name in ("reward.png", "samples-before.png", "samples-after.png"):
        assert (tmp_path / name).stat().st_size > 1000
