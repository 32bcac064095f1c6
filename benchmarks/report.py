"""The benchmark's outputs: a markdown table, the machine it ran on, and the files under ``--out``."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

_COLUMNS = (
    ("backbone", "backbone", "{}"),
    ("trainer", "trainer", "{}"),
    ("schedule", "schedule", "{}"),
    ("native s", "native_seconds", "{:.3f}"),
    ("optimized s", "optimized_seconds", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("ideal (FLOPs)", "ideal_speedup", "{:.2f}x"),
    ("measured/ideal", "ratio", "{:.2f}"),
    ("CPU-time speedup", "cpu_speedup", "{:.2f}x"),
    ("held MiB", "held_bytes", "{:.2f}"),
    ("buffers", "buffer_mode", "{}"),
    ("max rel weight diff", "max_rel_weight_diff", "{:.1e}"),
    ("reps", "repetitions", "{}"),
)


def machine_line() -> str:
    return (f"machine: {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
            f"python {platform.python_version()}, {platform.platform()}")


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row[key]
    return fmt.format(value / 2**20 if key == "held_bytes" else value)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for title, _, _ in _COLUMNS) + " |",
             "|" + "|".join("---" for _ in _COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(row, key, fmt) for _, key, fmt in _COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def results_markdown(rows: list[dict], machine: str) -> str:
    return (f"{markdown_table(rows)}\n\n"
            "speedup = median native step / median optimized step (wall clock, interleaved round-robin); ideal = FLOPs "
            "of a native step / FLOPs of an optimized step; CPU-time speedup uses this process's CPU time instead of "
            "wall clock; held = what the schedule keeps from the rollout to the update (retain: saved activations, "
            "reweight: gradient buffers).\n\n"
            f"{machine}\n")


def write_results(rows: list[dict], out: Path, machine: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(rows, indent=2) + "\n")
    md_path.write_text(results_markdown(rows, machine))
    return json_path, md_path
