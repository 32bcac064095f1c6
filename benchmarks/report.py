"""The benchmark's outputs: a markdown table, the machine it ran on, and the files under ``--out``."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from .loops import loops_markdown, on_policy_markdown

COLUMNS = (
    ("backbone", "backbone", "{}"),
    ("schedule of", "trainer", "{}"),
    ("tuning", "tuning", "{}"),
    ("program", "schedule", "{}"),
    ("native s", "native_seconds", "{:.3f}"),
    ("optimized s", "optimized_seconds", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("ideal (FLOPs)", "ideal_speedup", "{:.2f}x"),
    ("measured/ideal", "ratio", "{:.2f}"),
    ("limit", "limit_speedup", "{:.2f}x"),
    ("measured/limit", "limit_ratio", "{:.2f}"),
    ("predicted", "predicted_speedup", "{:.2f}x"),
    ("auto/best", "auto_vs_best", "{:.2f}"),
    ("bitwise/fastest", "bitwise_vs_fastest", "{:.2f}"),
    ("checks", "check_fraction", "{:.1%}"),
    ("CPU-time speedup", "cpu_speedup", "{:.2f}x"),
    ("held MiB", "held_bytes", "{:.2f}"),
    ("peak MiB", "peak_bytes", "{:.1f}"),
    ("auto's plan", "plan", "{}"),
    ("timed as", "timed_as", "{}"),
    ("max rel weight diff", "max_rel_weight_diff", "{:.1e}"),
    ("reps", "repetitions", "{}"),
    ("paper (8xA6000)", "paper", "{}"),
)

# LeanGRPO's reported speedups over native for the matching model and schedule (8x RTX A6000, FSDP2); the
# schedule "fast" has no reported counterpart.
PAPER = {("sd3", "flowgrpo"): "up to 1.83x (SD3.5-M)", ("flux", "dancegrpo"): "1.26-1.47x LoRA; full 1.18-1.81x",
         ("wan", "dancegrpo"): "1.22-1.49x (Wan 1.3B-14B)"}


def machine_line(jobs: int = 1) -> str:
    at_once = f", {jobs} cases measured at once (one process each)" if jobs > 1 else ""
    return (f"machine: {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s){at_once}, "
            f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}")


def _cell(row: dict, key: str, fmt: str) -> str:
    value = PAPER.get((row["backbone"], row["trainer"]), "-") if key == "paper" else row.get(key)
    if value is None or value == "":
        return "-"
    return fmt.format(value / 2**20 if key in ("held_bytes", "peak_bytes") else value)


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row, key, fmt) for _, key, fmt in columns) + " |" for row in rows]
    return "\n".join(lines)


def equivalence_markdown(runs: list[dict]) -> str:
    lines = ["| precision | GRPO steps | auto runs | calls served | max reward difference | weight rel. error | "
             "steps bitwise native |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['steps']} | {r['auto_runs']} | {r['served_calls']} | "
              f"{r['max_reward_diff']:.1e} | {r['weight_rel_error']:.1e} | {r['bitwise_steps']} |" for r in runs]
    return "\n".join(lines)


def results_markdown(rows: list[dict], machine: str, equivalence: list[dict] = (), loops: str = "") -> str:
    runs = (f"Native and auto trained side by side on the digits task (weights' error relative to native's total "
            f"update):\n\n{equivalence_markdown(equivalence)}\n\n") if equivalence else ""
    return (f"{markdown_table(rows)}\n\n{loops}{runs}"
            "speedup = median over rounds of native step / optimized step (wall clock; each round runs every program once, "
            "round-robin); native s, optimized s = median step times; ideal = FLOPs "
            "of a native step / FLOPs of an optimized step; CPU-time speedup uses this process's CPU time instead of "
            "wall clock; held = what the schedule keeps from the rollout to the update (retain: saved activations, "
            "reweight: gradient buffers); predicted = the planner's speedup for this CPU; auto/best = auto's speedup "
            "over the better of retain and reweight; auto's plan = its program and action per trained step.\n\n"
            f"{machine}\n")


def write_results(rows: list[dict], out: Path, machine: str, equivalence: list[dict] = (), loops: list[dict] = (),
                  on_policy: list[dict] = ()) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(rows, indent=2) + "\n")
    if equivalence:
        (out / "equivalence.json").write_text(json.dumps(list(equivalence), indent=2) + "\n")
    tables = ""
    if loops:
        (out / "loops.json").write_text(json.dumps({"loops": list(loops), "on_policy": list(on_policy)}, indent=2) + "\n")
        tables = ("The loops (examples/, benchmarks/public_loops.py), native and wrapped:\n\n"
                  f"{loops_markdown(loops)}\n\n")
    if on_policy:
        tables += f"The LLM loop's first micro-step, importance ratio:\n\n{on_policy_markdown(on_policy)}\n\n"
    md_path.write_text(results_markdown(rows, machine, equivalence, tables))
    plot_speedups(rows, out / "results.png")
    return json_path, md_path


def plot_speedups(rows: list[dict], path: Path) -> Path:
    """Measured speedup per row against its FLOP-ideal speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['backbone']}/{r['trainer']}/{r.get('tuning', '')}/{r['schedule']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar(xs, [r["speedup"] for r in rows], label="measured")
    ax.scatter(xs, [r["ideal_speedup"] for r in rows], color="black", marker="_", s=200, label="FLOP-ideal",
               zorder=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_ylabel("speedup over native")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
