"""The per-row program's fixed costs on a device, measured once per process (see :mod:`leancompile.cost.overheads`).

One layer of the tiny Wan backbone (a shipped family: diffusers' own modules and operators, at sizes where each
operator's arithmetic is negligible) is run eagerly and as its per-row program (:mod:`.rowwise`), as the rollout and
the update run them: a forward without grad over ``ROLLOUT_ROWS`` rows, a forward with grad and its backward over
``UPDATE_ROWS``; the program's first forward and backward, with its partition, are the compile; a kept call and
a served one through the reuse engine, less the program's own time, are the engine's cost per call. Each time but
the compile's is the best of ``REPEATS``; each is divided by the operators the cost profile counts in the call
(the engine's, per call). Seconds, once per process and device type.
"""
from __future__ import annotations

import functools
import time

import torch

from ..backbones import tiny
from ..cost.overheads import Overheads
from ..cost.profile import profile_call
from ..plan import Action, StepAction
from .calls import Call
from .engine import ReuseEngine
from .policy import StepPolicy
from .retain import Retain
from .rowwise import RowwiseBackbone

ROLLOUT_ROWS = 4
UPDATE_ROWS = 2
REPEATS = 7
ENGINE_CALLS = 4  # kept and served calls per timed step of the engine


@functools.cache
def overheads(device_type: str = "cpu") -> Overheads:
    """The per-operator costs of eager and of the per-row program on ``device_type`` ("cpu" or "cuda")."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda'; got {device_type!r}")
    device = torch.device(device_type)
    # A first compile in the process imports AOTAutograd and the tracers (seconds, once): paid on a linear layer
    # first, so that the compile timed below is what each program's costs.
    with torch.random.fork_rng(devices=[]):  # its initial weights drawn on the CPU, the caller's stream untouched
        linear = torch.nn.Linear(2, 2).to(device)
    _compile(linear, (torch.ones(2, 2, device=device),))
    compile_seconds, (backbone, args, rowwise, key, call, kept, cotangent) = _compile(*_model(device))
    # per operator as the planner counts them (the cost profile's): the program's costs are priced per such operator
    profile = profile_call(backbone)
    forward_ops, backward_ops = profile.forward.count, profile.backward.count
    update = (args[0][:UPDATE_ROWS], args[1][:UPDATE_ROWS], args[2].index(torch.arange(UPDATE_ROWS)))
    weights = list(backbone.parameters())

    def native_update():
        out = backbone(*update)
        torch.autograd.grad(out, weights, torch.ones_like(out))

    with torch.no_grad():
        eager_forward = _best(lambda: backbone(*args), device)
    eager_update = _best(native_update, device)
    program_forward = _best(lambda: rowwise.forward(key, call), device)
    program_backward = _best(lambda: rowwise.backward(key, kept, cotangent), device)
    policy = StepPolicy()
    engine = ReuseEngine(backbone, Retain(), {1.0: rowwise}, policy, timed=True)

    def engine_step() -> float:
        """A step's worth of kept and served calls (its once-a-step costs, the weights' fingerprint, shared by
        them as in a trainer's step): the time the engine adds per call to the program's own, which its records
        time in the same run (so that a busy machine slows both alike)."""
        start = _now(device)
        for _ in range(ENGINE_CALLS):
            with torch.no_grad(), policy.keeping(StepAction(0, Action.RETAIN)):
                engine(*args)
        for _ in range(ENGINE_CALLS):
            out = engine(*update)
            torch.autograd.grad(out, weights, torch.ones_like(out))
        added = _now(device) - start - sum(r.seconds for r in engine.log.records)
        engine.end_step()
        return max(added, 0.0) / (2 * ENGINE_CALLS)

    # reading the module's state, digesting and looking up the rows, keeping and gathering them (the first warms)
    per_call = min(engine_step() for _ in range(REPEATS + 1))
    both = forward_ops + backward_ops
    return Overheads(device_type, eager_forward / forward_ops, eager_update / both, program_forward / forward_ops,
                     program_backward / both, per_call, compile_seconds / both, (forward_ops, backward_ops))


def _model(device: torch.device):
    """The tiny Wan backbone with one block, every weight trainable, and a rollout call's arguments."""
    generator = torch.Generator().manual_seed(0)  # drawn on the CPU: the caller's random streams stay as they were
    backbone = tiny("wan", num_layers=1).to(device).requires_grad_(True)  # (its weights under a forked stream)
    x = torch.randn(ROLLOUT_ROWS, *backbone.latent_shape, generator=generator).to(device)
    sigma = torch.rand(ROLLOUT_ROWS, generator=generator).to(device)
    return backbone, (x, sigma, backbone.dummy_conditioning(ROLLOUT_ROWS, generator))


def _compile(module, args: tuple):
    """Seconds to compile ``module``'s per-row program for ``args`` and run its first forward (over every row) and
    backward (over ``UPDATE_ROWS``), which trace; and what runs it."""
    rowwise, key, call = RowwiseBackbone(module), ("calibration",), Call.of(args, {})
    device = call.device
    start = _now(device)
    program = rowwise.program(key, call)
    if program.refusal is not None:
        raise RuntimeError(f"the calibration's per-row program did not compile: {program.refusal}")
    out, saved = rowwise.forward(key, call)
    kept, cotangent = [t[:UPDATE_ROWS] for t in saved], torch.ones_like(out[:UPDATE_ROWS])
    rowwise.backward(key, kept, cotangent)
    seconds = _now(device) - start
    return seconds, (module, args, rowwise, key, call, kept, cotangent)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _best(fn, device: torch.device) -> float:
    fn()  # warm: the allocator, lazy initialisations
    times = []
    for _ in range(REPEATS):
        start = _now(device)
        fn()
        times.append(_now(device) - start)
    return min(times)
