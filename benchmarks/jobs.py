"""Run the benchmark's tasks (a case, an equivalence run) one after another, or several at once in worker
processes."""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch


def single_threaded() -> None:
    # The tiny backbones gain nothing from intra-op threads, and one thread per process keeps a process's
    # programs on one core, so the tasks run at once do not take cores from each other.
    torch.set_num_threads(1)


def _timed(fn, *args):
    single_threaded()
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def run_tasks(tasks: list[tuple], jobs: int):
    """Yield ``(index, result, seconds)`` for each ``(fn, *args)`` task as it finishes. With several jobs each task
    runs whole in one worker process, where a case's programs still alternate round by round; the other workers'
    steps slow them unevenly all the same, so the ratios are noisier than with one job."""
    if jobs == 1:
        for i, (fn, *args) in enumerate(tasks):
            yield i, *_timed(fn, *args)
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_timed, fn, *args): i for i, (fn, *args) in enumerate(tasks)}
        for future in as_completed(futures):
            yield futures[future], *future.result()
