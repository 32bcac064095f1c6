import json

from leancompile import cli


def test_demo_writes_metrics_curve_and_grids(tmp_path):
    assert cli.main(["demo", "--steps", "2", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    rows = metrics["schedules"]["native"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["reward_mean"] <= 1 and r["step_seconds"] > 0 for r in rows)
    for name in ("reward.png", "samples-before.png", "samples-after.png"):
        assert (tmp_path / name).stat().st_size > 1000
