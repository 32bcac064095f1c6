"""The benchmark's machinery on the smallest case: a row per schedule with the promised fields and matching
weights."""
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cases, measure_case
from benchmarks.measure import build_programs, counted_step, max_rel_weight_diff
from benchmarks.report import machine_line, write_results
from conftest import steps_clock

FIELDS = {"backbone": str, "trainer": str, "tuning": str, "schedule": str, "runs": str, "plan": str,
          "predicted_speedup": float, "speedup": float, "ideal_speedup": float,
          "ratio": float, "held_bytes": int, "native_seconds": float, "optimized_seconds": float,
          "repetitions": int, "max_rel_weight_diff": float}


@pytest.fixture(scope="module")
def rows():
    case = cases(families=["sd3"], trainers=["fast"], tunings=["lora"], smallest=True)[0]
    return measure_case(case, repetitions=1)


@pytest.fixture
def row(rows):
    return rows[0]


def test_rows_have_the_promised_fields(rows):
    assert [r["schedule"] for r in rows] == ["retain", "reweight", "auto"]
    for row in rows:
        for key, kind in FIELDS.items():
            assert isinstance(row[key], kind), key
        assert (row["backbone"], row["trainer"], row["tuning"], row["repetitions"]) == ("sd3", "fast", "lora", 1)
        assert row["ratio"] == pytest.approx(row["speedup"] / row["ideal_speedup"])
        assert row["ideal_speedup"] > 1 and row["held_bytes"] > 0
        assert row["limit_ratio"] == pytest.approx(row["speedup"] / row["limit_speedup"])
        assert row["served_calls"] > 0 and row["recomputed_calls"] == 0
    # Retain removes exactly the update's repeated forwards: its FLOP-ideal is the method's limit.
    assert rows[0]["limit_speedup"] == pytest.approx(rows[0]["ideal_speedup"], rel=0.02)
    auto = rows[2]
    assert auto["runs"] in ("retain", "reweight") and auto["plan"] and auto["auto_vs_best"] > 0
    if auto["timed_as"] != "auto":  # against the program it compiled to, every round's ratio is 1
        assert auto["auto_vs_best"] <= 1.0
    assert all(action in auto["plan"] for action in [auto["runs"]]) or "@" in auto["plan"]


def test_every_schedule_trains_the_same_weights_as_native(rows):
    assert all(row["max_rel_weight_diff"] < 1e-4 for row in rows)


def test_a_compiling_step_counts_the_flops_every_later_step_computes():
    case = cases(families=["flux"], trainers=["fast"], tunings=["lora"], smallest=True)[0]
    programs = build_programs(case, ("retain",))
    native, retain = (counted_step(programs[name], list(case.prompts))[1] for name in ("native", "retain"))
    # Retain's first step traces its partition on functional fake tensors; that tracing computes nothing.
    assert counted_step(programs["retain"], list(case.prompts))[1] == retain < native
    assert counted_step(programs["native"], list(case.prompts))[1] == native


def test_results_are_written_as_json_and_markdown(row, tmp_path):
    json_path, md_path = write_results([row], tmp_path / "out", machine_line())
    assert json.loads(json_path.read_text())[0]["trainer"] == "fast"
    text = md_path.read_text()
    assert "| sd3 | fast | lora | retain |" in text and "torch " + torch.__version__ in text
    assert (json_path.parent / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_a_diverged_run_never_counts_as_equal():
    class Weights:
        def __init__(self, value):
            self.trainable = [torch.full((2,), value)]

    assert max_rel_weight_diff(Weights(1.0), Weights(float("nan"))) == math.inf
    assert max_rel_weight_diff(Weights(1.0), Weights(1.0)) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole GPU benchmark")
def test_the_gpu_script_says_why_it_skips_without_cuda():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh")], capture_output=True, text=True,
                          env={"PY": sys.executable, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "no CUDA device here" in done.stderr and "skipping" in done.stderr


@pytest.mark.parametrize("argv", [["--repetitions", "0"], ["--min-seconds", "-1"], ["--min-seconds", "nan"],
                                  ["--jobs", "0"]])
def test_bad_timing_budgets_are_refused_with_the_option_named(argv, capsys):
    from benchmarks.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_cases_measured_at_once_come_back_in_the_order_asked():
    from benchmarks.jobs import run_tasks

    tasks = [(sorted, [3, 1, 2]), (pow, 2, 10), (max, 4, 9), (abs, -5)]
    done = {jobs: sorted((i, result) for i, result, seconds in run_tasks(tasks, jobs)) for jobs in (1, 2)}
    assert done[1] == done[2] == [(0, [1, 2, 3]), (1, 1024), (2, 9), (3, 5)]


def test_quick_mode_runs_each_backbone_and_each_schedule_once_and_the_grid_runs_every_pair():
    from benchmarks.__main__ import parse_args, selected_cases

    quick = [(c.backbone, c.trainer) for c in selected_cases(parse_args([]))]
    assert sorted(b for b, _ in quick) == ["flux", "sd3", "wan"]
    assert sorted(t for _, t in quick) == ["dancegrpo", "fast", "flowgrpo"]
    assert len(selected_cases(parse_args(["--grid"]))) == 9
    full = selected_cases(parse_args(["--full"]))
    assert len(full) == 18 and {c.tuning for c in full} == {"lora", "full"}
    assert [(c.backbone, c.trainer) for c in selected_cases(parse_args(["--backbones", "sd3"]))] == [
        ("sd3", "flowgrpo"), ("sd3", "fast"), ("sd3", "dancegrpo")]


def test_grid_and_full_are_refused_together(capsys):
    from benchmarks.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--grid", "--full"])
    assert "--full" in capsys.readouterr().err


def test_interleaved_rounds_alternate_which_program_goes_first():
    from types import SimpleNamespace

    from benchmarks.measure import interleaved_times

    order = []
    program = lambda name: SimpleNamespace(device=torch.device("cpu"), step=lambda _: order.append(name) or {})
    times, _ = interleaved_times({"native": program("native"), "wrapped": program("wrapped")}, None, 4)
    assert order == ["native", "wrapped", "wrapped", "native"] * 2
    assert [len(t) for t in times.values()] == [4, 4]


def test_a_loop_row_times_the_loop_natively_and_wrapped(monkeypatch):
    """The loop benchmark's machinery on a small LLM loop: both programs stepped, FLOPs counted, calls served; more
    rounds where a time budget asks for them."""
    from benchmarks import loops
    from examples import grpo_llm

    monkeypatch.setitem(loops.LOOPS, "llm/grpo", (grpo_llm.Loop, grpo_llm.Config(prompts=2, group=2, micro_batch=2)))
    step = loops.timed_step  # the step that sizes the rounds, taken as half a second
    monkeypatch.setattr(loops, "timed_step", lambda *a: (dataclasses.replace(step(*a)[0], wall=0.5), {}))
    row = loops.measure_loop("llm/grpo", repetitions=1, min_seconds=1.6)
    assert row["repetitions"] == len(row["native_times"]) == len(row["optimized_times"]) == 4
    assert row["served_calls"] == 2 and row["recomputed_calls"] == 0
    assert row["native_flops"] > row["optimized_flops"] > 0  # the update's forwards are gone
    assert "| llm/grpo (full), wrap (retain) |" in loops.loops_markdown([row])


def test_an_interrupted_run_writes_the_rows_it_measured(row, tmp_path, monkeypatch):
    """A time limit (benchmarks/gpu.sh stops the run with SIGINT) keeps what was measured, and says it stopped."""
    import benchmarks.__main__ as main

    def first_then_interrupt(tasks, jobs):
        yield 0, [row], 1.0
        raise KeyboardInterrupt

    monkeypatch.setattr(main, "run_tasks", first_then_interrupt)
    code = main.main(["--backbones", "sd3", "--trainers", "fast", "--out", str(tmp_path)])
    assert code == 130
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps([row]))


def test_the_bitwise_row_trains_native_weights_bit_for_bit_and_says_what_it_costs():
    case = cases(families=["wan"], trainers=["dancegrpo"], tunings=["lora"], smallest=True)[0]
    rows = measure_case(case, repetitions=1, schedules=("retain", "bitwise"))
    bitwise = next(r for r in rows if r["schedule"] == "bitwise")
    assert bitwise["max_rel_weight_diff"] == 0.0 and bitwise["served_calls"] > 0
    assert bitwise["predicted_speedup"] is None and bitwise["bitwise_vs_fastest"] > 0


def test_the_equivalence_run_completes_where_auto_falls_back(monkeypatch):
    """``make bench``'s side-by-side training where auto's trial falls back to native (the program measured slower
    over whole steps): the optimized trainer's steps report the engine's keys whatever ran, before and after."""
    from benchmarks.equivalence import train_side_by_side
    from leancompile.runtime import auto

    monkeypatch.setattr(auto, "AUTO_FLOOR", 0.97)
    monkeypatch.setattr(auto, "now", steps_clock(1.2, 1.2))
    result = train_side_by_side(9, "float64")
    assert result["steps"] == 9 and result["served_calls"] > 0 and result["weight_rel_error"] <= 1e-10


def test_a_row_of_auto_that_fell_back_to_native_reads_the_native_step(monkeypatch):
    """auto measured slower over whole steps runs natively: its row is native's timing, and holds and serves
    nothing (the native trainer's step has no engine statistics of its own)."""
    from leancompile.runtime import auto

    from leancompile import api

    monkeypatch.setattr(auto, "AUTO_FLOOR", 0.97)
    monkeypatch.setattr(auto, "now", steps_clock(1.2))
    monkeypatch.setattr(api, "_runner_up", lambda cost, chosen: None)  # one trial (test_auto tries the runner-up)
    case = cases(families=["sd3"], trainers=["fast"], tunings=["lora"], smallest=True)[0]
    row = measure_case(case, repetitions=1, schedules=("auto",))[0]
    assert (row["timed_as"], row["held_bytes"], row["served_calls"], row["speedup"]) == ("native", 0, 0, 1.0)
