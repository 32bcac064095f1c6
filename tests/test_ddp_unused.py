"""``leancompile.wrap`` with DDP's ``find_unused_parameters=True`` (accelerate's ``DistributedDataParallelKwargs``,
Flow-Factory's default) and ``static_graph=True``, wrapped after DDP and before it, with and without gradient
accumulation under ``no_sync()``: DDP's forward runs around every call as natively (its reducer armed on the
served output, whose graph reaches exactly the parameters native's does), the module it holds serves the update's
calls, and the weights after the optimizer steps agree with an unwrapped DDP run's to float64 rounding after as
many gradient all-reduces. Float64, one gloo rank; accelerate's ``prepare`` on two."""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import leancompile
from leancompile import backbones
from conftest import spawn_ranks

DTYPE = torch.float64
ROWS, STEPS = 4, 2  # rows per rollout call; rollout-update-step iterations
OPTIONS = {"find_unused_parameters": dict(find_unused_parameters=True), "static_graph": dict(static_graph=True)}


def _sequential():
    """A plain ``nn.Sequential`` with a parameter its forward never reads (DDP finds it unused)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(DTYPE)
    model.register_parameter("idle", torch.nn.Parameter(torch.zeros(3, dtype=DTYPE)))
    return model


def _sequential_inputs(generator):
    return dict(input=torch.randn(ROWS, 6, generator=generator, dtype=DTYPE))


def _sd3():
    return backbones.tiny("sd3", seed=0, dtype=DTYPE).model


def _sd3_inputs(generator):
    backbone = backbones.tiny("sd3", seed=0, dtype=DTYPE)
    text = backbone.dummy_conditioning(ROWS, generator, dtype=DTYPE)
    latents = torch.randn(ROWS, *backbone.latent_shape, generator=generator, dtype=DTYPE)
    return dict(hidden_states=latents, timestep=torch.rand(ROWS, generator=generator, dtype=DTYPE) * 1000,
                encoder_hidden_states=text.text, pooled_projections=text.pooled, return_dict=False)


MODELS = {"sequential": (_sequential, _sequential_inputs), "sd3": (_sd3, _sd3_inputs)}


def _output(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result[0]


def _micro(inputs: dict, rows: slice) -> dict:
    return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _train(module, ddp, optimizer, inputs, accumulate: bool, stats) -> None:
    """One GRPO-like step: the rollout's call without grad, the update's two micro-batches with grad (the first
    under ``ddp.no_sync()`` where ``accumulate``), an optimizer step."""
    with torch.no_grad():
        module(**inputs)
    for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        sync = ddp.no_sync() if accumulate and rows.start == 0 else contextlib.nullcontext()
        with sync:
            _output(module(**_micro(inputs, rows))).square().mean().backward()
    stats()
    optimizer.step()
    optimizer.zero_grad()


def run(model: str, where: str | None, options: str, accumulate: bool = False, seed: int = 0) -> dict:
    """``STEPS`` steps on DDP(``OPTIONS[options]``) around ``model``, wrapped ``where`` ("before" or "after"
    DDP; None: native); the weights' change over them, the all-reduces DDP ran and the wrapped module's stats at
    each optimizer step."""
    build, make_inputs = MODELS[model]
    torch.manual_seed(0)
    inner = build()
    if where == "before":
        inner = leancompile.wrap(inner)
    ddp = DistributedDataParallel(inner, **OPTIONS[options])
    allreduces = [0]

    def counted(state, bucket):
        allreduces[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counted)
    module = leancompile.wrap(ddp) if where == "after" else ddp
    stats = []
    wrapped = {"after": module, "before": inner}.get(where)
    read = (lambda: stats.append(wrapped.stats())) if wrapped is not None else (lambda: None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    weights = lambda: torch.cat([p.detach().flatten() for p in inner.parameters()])  # noqa: E731
    start = weights()
    for _ in range(STEPS):
        _train(module, ddp, optimizer, make_inputs(generator), accumulate, read)
    return dict(change=weights() - start, allreduces=allreduces[0], stats=stats)


# (model, wrapped before or after DDP, DDP's options, accumulation under no_sync()). Not static_graph with
# no_sync(): DDP alone fails there (an internal assert in its reducer's first backward under no_sync()).
CASES = [("sequential", where, options, accumulate) for where in ("after", "before")
         for options, accumulate in (("find_unused_parameters", False), ("find_unused_parameters", True),
                                     ("static_graph", False))] + [
    ("sd3", "after", "find_unused_parameters", True),
    ("sd3", "before", "find_unused_parameters", False),
    ("sd3", "after", "static_graph", False),
]


def _nested() -> dict:
    """A module holding a DDP, wrapped: refused before its first call (tracing would run DDP's forward), so its
    update runs natively and says why."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_sequential(), find_unused_parameters=True)
    module = leancompile.wrap(torch.nn.Sequential(ddp))
    inputs = _sequential_inputs(torch.Generator().manual_seed(0))
    with torch.no_grad():
        module(**inputs)
    module(**inputs).square().mean().backward()
    return module.stats()


def _worker(rank, port, which, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    torch.set_num_threads(1)
    if which == "quick":
        results = {"nested": _nested(), **_runs([QUICK])}
    else:
        results = _runs(CASES)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _runs(cases: list) -> dict:
    """Per case: the native run (DDP alone) and the wrapped one."""
    return {case: (run(case[0], None, *case[2:]), run(*case)) for case in cases}


QUICK = ("sequential", "after", "find_unused_parameters", False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return spawn_ranks(_worker, 1, tmp_path_factory.mktemp("quick"), "quick")[0]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return spawn_ranks(_worker, 1, tmp_path_factory.mktemp("cases"), "cases")[0]


def _check(native: dict, wrapped: dict) -> None:
    assert native["change"].norm() > 0
    assert float((wrapped["change"] - native["change"]).norm() / native["change"].norm()) <= 1e-10
    assert wrapped["allreduces"] == native["allreduces"] > 0  # every synced backward all-reduced, as natively
    assert len(wrapped["stats"]) == STEPS
    for stats in wrapped["stats"]:  # both micro-batches of each step served
        assert stats["served_calls"] == 2 and stats["recomputed_calls"] == 0, stats


@pytest.mark.fast
def test_wrapped_after_ddp_with_find_unused_parameters_serves_and_trains_as_ddp(quick):
    """The issue's case: a plain ``nn.Sequential`` in DDP(find_unused_parameters=True), then wrapped."""
    _check(*quick[QUICK])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    [c[0], f"wrapped {c[1]} ddp", c[2], *(["no_sync accumulation"] if c[3] else [])]))
def test_ddp_options_wrapped_before_or_after_serve_and_train_as_ddp(cases, case):
    _check(*cases[case])


def test_a_ddp_inside_the_wrapped_module_runs_natively_and_says_why(quick):
    stats = quick["nested"]
    assert stats["served_calls"] == 0 and stats["recomputed_calls"] == 1
    assert set(stats["recompute_reasons"]) == {"unsupported"}, stats


def run_accelerated(model: str, where: str | None, seed: int) -> dict:
    """``STEPS`` steps through accelerate (``prepare`` with ``DistributedDataParallelKwargs(find_unused_parameters=
    True)``, two micro-batches per optimizer step under ``accelerator.accumulate``), the module wrapped ``where``
    ("before" or "after" ``prepare``; None: native); the weights' change and the wrapped module's stats."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    build, make_inputs = MODELS[model]
    torch.manual_seed(0)
    inner = build()
    if where == "before":
        inner = leancompile.wrap(inner)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    module, optimizer = accelerator.prepare(inner, optimizer)
    assert isinstance(module, DistributedDataParallel)
    if where == "after":
        module = leancompile.wrap(module)
    wrapped, stats = {"after": module, "before": inner}.get(where), []
    generator = torch.Generator().manual_seed(seed)  # each rank its own rows
    weights = lambda: torch.cat([p.detach().flatten() for p in inner.parameters()])  # noqa: E731
    start = weights()
    for _ in range(STEPS):
        inputs = make_inputs(generator)
        with torch.no_grad():
            module(**inputs)
        for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
            with accelerator.accumulate(module):
                accelerator.backward(_output(module(**_micro(inputs, rows))).square().mean())
                if accelerator.sync_gradients and wrapped is not None:
                    stats.append(wrapped.stats())
                optimizer.step()
                optimizer.zero_grad()
    return dict(change=weights() - start, stats=stats)


ACCELERATED = [("sequential", "after"), ("sequential", "before"), ("sd3", "after")]


def _accelerate_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {(model, where): run_accelerated(model, where, seed=rank)
               for model in dict.fromkeys(m for m, _ in ACCELERATED) for where in (None, "after", "before")
               if where is None or (model, where) in ACCELERATED}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def accelerated(tmp_path_factory):
    pytest.importorskip("accelerate")
    return spawn_ranks(_accelerate_worker, 2, tmp_path_factory.mktemp("accelerated"))


@pytest.mark.parametrize("model, where", ACCELERATED, ids=lambda v: v if v in MODELS else f"wrapped {v} prepare")
def test_accelerate_with_find_unused_parameters_serves_and_trains_as_accelerate(accelerated, model, where):
    """Two gloo ranks, each on its own rows: the gradients are averaged over the ranks as natively."""
    for rank in accelerated:
        native, wrapped = rank[(model, None)], rank[(model, where)]
        assert native["change"].norm() > 0
        assert float((wrapped["change"] - native["change"]).norm() / native["change"].norm()) <= 1e-10
        assert len(wrapped["stats"]) == STEPS
        for stats in wrapped["stats"]:
            assert stats["served_calls"] == 2 and stats["recomputed_calls"] == 0, stats
    assert torch.equal(accelerated[0][(model, where)]["change"], accelerated[1][(model, where)]["change"])
