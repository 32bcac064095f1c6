"""The planner: per trained step, the fastest way to serve the update's backbone calls that fits in memory.

A GRPO step's memory is a sum of components (weights, gradients, optimizer state, EMA, reference model, and what
each schedule holds from the rollout to the update), written as sympy expressions in the batch, the tokens, the
retained steps and the world size; its time is the roofline time of the backbone calls each schedule runs.
Per trained step the planner picks one of

* ``retain``: keep the rollout's activations (the update's forward disappears);
* ``retain`` at a fraction ``f`` (``retain@f``): keep a fraction ``f`` of them, the min-cut partitioner
  recomputing the rest in the backward;
* ``offload``: keep them in host memory (where the device has a host link and the copy costs less than the forward);
* ``recompute``: keep nothing, the update runs its forward again (native);

and compares the best such mix with Reweight (gradient buffers instead of activations, for all trained steps) and
with the native program. Activations are linear in the retained steps, so the best mix retains whole steps while
they fit, one step partially with what is left, and offloads or recomputes the rest.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..plan import AUTO, Action, Refusal, Schedule, StepAction
from .devices import Device, GiB
from .overheads import Overheads
from .profile import PARTIAL_BUDGETS, CallProfile
from .sharding import Sharding, sharding

if TYPE_CHECKING:
    import sympy

MARGIN = 0.9  # of the device's free memory: allocator fragmentation and the CUDA context need the rest
_SMALLEST_PARTIAL = 0.05  # a partial retention below this saves too little of a forward to be worth a compile


@dataclass(frozen=True)
class Scenario:
    """One GRPO step of a trainer on a device: what the planner weighs."""

    config: object  # the trainer's GRPOConfig
    num_samples: int  # samples per GRPO step (prompts x group size), per rank
    profile: CallProfile  # one backbone call of one row
    total_params: int
    trainable_params: int
    weight_bytes: int  # per element of a frozen weight
    trainable_bytes: int  # per element of a trainable weight, its gradient and each optimizer moment
    latent_bytes: int  # one row's backbone output
    compute_dtype: torch.dtype
    refusals: tuple[Refusal, ...] = ()  # the schedules that cannot run here, and why
    advantage_free: bool = False  # the loss has advantage-free terms: Reweight backpropagates twice
    buffers: int | None = None  # gradient buffers Reweight holds at its peak (None: one per window sample)
    world_size: int = 1
    sharding: str = "ddp"  # a name of sharding.SHARDINGS: "ddp" replicates weights and optimizer state

    def __post_init__(self):
        sharding(self.sharding)  # a clear error for an unknown name

    @property
    def layout(self) -> Sharding:
        return sharding(self.sharding)


@dataclass(frozen=True)
class Estimate:
    """A schedule's predicted peak memory and step time."""

    schedule: str  # a Schedule's value, or "auto"
    fits: bool
    peak_bytes: int
    components: tuple[tuple[str, int], ...]
    seconds: float
    flops: float
    steps: tuple[StepAction, ...] = ()  # per eligible trained step, by position
    runs: Schedule = Schedule.NATIVE  # the program it runs (auto: Retain for any mix of retained steps)
    note: str = ""
    per_block: bool = False  # Retain runs per transformer block (the sharding's own gathers; runtime.regional)

    @property
    def available(self) -> bool:
        """Whether the schedule can run here at all (a refused one has no time, and its note says why)."""
        return math.isfinite(self.seconds)


@dataclass(frozen=True)
class CostPlan:
    """Predictions for native, retain, reweight and the planner's choice (``auto``) on one device."""

    device: str
    budget: int
    estimates: tuple[Estimate, ...]
    limits: tuple[tuple[str, str], ...] = ()
    overheads: Overheads | None = None  # the per-operator costs measured on the device (None: a named device's)
    compile_seconds: float = 0.0  # compiling the per-row program: the first step's extra
    run_steps: int | None = None  # GRPO steps of the run, over which the compile is amortised (None: unknown)

    def __getitem__(self, schedule: str) -> Estimate:
        for e in self.estimates:
            if e.schedule == schedule:
                return e
        raise KeyError(schedule)

    def speedup(self, schedule: str) -> float:
        return self["native"].seconds / self[schedule].seconds

    def flop_ideal(self, schedule: str) -> float:
        return self["native"].flops / self[schedule].flops

    def to_json(self) -> dict:
        return {"device": self.device, "budget_bytes": self.budget,
                "schedules": {e.schedule: {"fits": e.fits, "peak_bytes": e.peak_bytes,
                                           "speedup": round(self.speedup(e.schedule), 4),
                                           "flop_ideal_speedup": round(self.flop_ideal(e.schedule), 4),
                                           # A refused schedule has no time: JSON has no infinity.
                                           "step_seconds": e.seconds if e.available else None,
                                           "components": dict(e.components),
                                           "steps": [a.label for a in e.steps], "runs": str(e.runs),
                                           "note": e.note}
                              for e in self.estimates},
                "limits": dict(self.limits),
                "overheads": None if self.overheads is None else {
                    k: v for k, v in asdict(self.overheads).items() if k != "device"},
                "compile_seconds": self.compile_seconds, "run_steps": self.run_steps}

    def __str__(self) -> str:
        names = [name for name, _ in self["native"].components]
        for e in self.estimates:
            names += [n for n, _ in e.components if n not in names]
        head = f"{'':<26}" + "".join(f"{e.schedule:>12}" for e in self.estimates)
        lines = [f"device {self.device}, budget {format_bytes(self.budget)}", head]

        def row(label, cell):  # a schedule that cannot run here has no figures
            return f"  {label:<24}" + "".join(f"{cell(e) if e.available else '-':>12}" for e in self.estimates)

        lines += [row(name, lambda e: format_bytes(dict(e.components).get(name, 0))) for name in names]
        lines += [row("peak", lambda e: format_bytes(e.peak_bytes)),
                  f"  {'fits':<24}" + "".join(f"{'yes' if e.fits else 'NO':>12}" for e in self.estimates),
                  row("step time (s)", lambda e: f"{e.seconds:.3g}"),
                  row("speedup", lambda e: f"{self.speedup(e.schedule):.2f}x"),
                  row("FLOP-ideal speedup", lambda e: f"{self.flop_ideal(e.schedule):.2f}x")]
        lines += [f"  {e.schedule} cannot run: {e.note}" for e in self.estimates if not e.available]
        auto = self["auto"]
        lines.append(f"auto runs {auto.runs}: {auto.note}")
        if auto.steps:
            lines.append("  per trained step: " + " ".join(a.label for a in auto.steps))
        lines += [f"  {name}: {value}" for name, value in self.limits]
        lines += [f"  per-operator costs: {self.overheads}" if self.overheads is not None else
                  "  per-operator costs: not measured (planned without a calibration, as for a named device): the "
                  "per-row program is priced as eager, one launch cost per operator",
                  f"  {self.compile_line()}"]
        return "\n".join(lines)

    def compile_line(self) -> str:
        """The first step's extra, and how the step times above count it."""
        if self.overheads is None:
            return "first step: compiling the per-row program (seconds; not priced without a measurement)"
        head = f"first step: compiling the per-row program takes about {self.compile_seconds:.2g} s"
        if self.run_steps is None:
            return (f"{head}, not amortised: the run's length is unknown (the trainer's config has no "
                    "num_grpo_steps), so the step times above leave it out")
        return (f"{head}, amortised over the run's {self.run_steps} GRPO steps: "
                f"{self.compile_seconds / self.run_steps:.2g} s a step, in the step times above")


def format_bytes(n: float) -> str:
    """GiB, or MiB below a hundredth of one."""
    return f"{n / GiB:.2f} GiB" if n >= 0.01 * GiB else f"{n / 2 ** 20:.2f} MiB"


# ------------------------------------------------------------------------------------------------ memory model

@functools.cache
def _memory_model():
    """sympy and the memory model's symbols: rows, tokens, retained steps, world size. sympy is imported by the
    first plan, not with leancompile (its import takes a fifth of a second)."""
    import sympy

    return (sympy, *sympy.symbols("rows tokens retained_steps world", positive=True))


def static_memory(s: Scenario) -> dict[str, sympy.Expr]:
    """What every schedule holds: weights, gradients, optimizer moments, EMA and the KL reference, each rank its
    shard of them under a sharded layout, and the blocks' weights it holds gathered during a call."""
    sympy, _, _, _, WORLD = _memory_model()
    cfg = s.config
    layout = s.layout
    shard = WORLD if layout.sharded else 1
    frozen = s.total_params - s.trainable_params
    parts = {"weights": (frozen * s.weight_bytes + s.trainable_params * s.trainable_bytes) / shard,
             "gradients": s.trainable_params * s.trainable_bytes / shard,
             "optimizer (AdamW)": 2 * s.trainable_params * s.trainable_bytes / shard}
    if cfg.ema:
        parts["EMA"] = s.trainable_params * s.trainable_bytes / shard
    if cfg.beta > 0 and cfg.lora_rank is None:  # LoRA's reference is the same model with adapters off
        parts["reference model"] = s.total_params * s.weight_bytes / shard
    gathered = layout.gathered_bytes(_whole_weights(s), s.profile.blocks, s.world_size)
    if gathered:
        parts["gathered blocks"] = gathered
    return {k: sympy.sympify(v) for k, v in parts.items()}


def _whole_weights(s: Scenario) -> int:
    """Bytes of every weight, unsharded (a block's taken as their average per block where a layout gathers by
    block: the embeddings and output layers are a small part)."""
    return (s.total_params - s.trainable_params) * s.weight_bytes + s.trainable_params * s.trainable_bytes


def activations_per_row(s: Scenario, per_block: bool = False) -> sympy.Expr:
    """Bytes one row of one retained call keeps, as a function of the tokens (linear: the attention kernels
    save per-token statistics, not the attention matrix). Per block (runtime.regional): what the blocks' own
    partitions save."""
    sympy, _, TOKENS, _, _ = _memory_model()
    kept = s.profile.block_retained_bytes if per_block else s.profile.retained_bytes
    return sympy.Rational(kept, s.profile.tokens) * TOKENS


def call_memory(s: Scenario, checkpointing: bool, partition: bool = False) -> sympy.Expr:
    """The activations of one call in flight (rows = its batch): eager autograd's (the native update), the
    partition's (Reweight's provisional call), or under checkpointing the blocks' inputs and one block."""
    sympy, ROWS, TOKENS, _, _ = _memory_model()
    if partition:
        return ROWS * activations_per_row(s)
    if not checkpointing:
        return ROWS * sympy.Rational(s.profile.eager_bytes, s.profile.tokens) * TOKENS
    blocks = max(1, s.profile.blocks)
    per_row = sympy.Rational(s.profile.checkpoint_bytes + s.profile.retained_bytes // blocks, s.profile.tokens)
    return ROWS * per_row * TOKENS


# --------------------------------------------------------------------------------------------- step geometry

@dataclass(frozen=True)
class Geometry:
    eligible: int  # denoising steps that may be trained
    rollout_rows: int  # rows of one rollout call (CFG doubles)
    rollout_calls: int  # rollout calls per denoising step
    update_rows: int  # rows of one update call
    retained_rows: float  # rows the rollout keeps per eligible step (all samples that train it)
    window_calls: float  # update calls per eligible step before the first optimizer step
    window_samples: int
    micro_steps: float  # update calls per GRPO step, all epochs
    optimizer_steps: int


def _geometry(s: Scenario) -> Geometry:
    cfg, n = s.config, s.num_samples
    k = cfg.num_trained_steps
    eligible = {"first": k, "window": k}.get(cfg.trained_steps, cfg.counted_steps)
    segments = 2 if cfg.use_cfg else 1
    train_segments = 2 if cfg.use_cfg and cfg.train_cfg else 1
    b_r = min(cfg.sample_batch_size or n, n)
    per_batch = cfg.train_batch_size
    window = min(n, cfg.gradient_accumulation_steps * per_batch)
    share = k / eligible
    return Geometry(eligible, segments * b_r, math.ceil(n / b_r), train_segments * per_batch,
                     segments * n * share, window / per_batch * share, window,
                     cfg.num_inner_epochs * n / per_batch * k,
                     cfg.num_inner_epochs * math.ceil(n / (per_batch * cfg.gradient_accumulation_steps)))


# ------------------------------------------------------------------------------------------------ the planner

@dataclass(frozen=True)
class StepModel:
    """What every schedule's estimate starts from: one GRPO step of a scenario on a device, and native's cost."""

    scenario: Scenario
    device: Device
    budget: int
    geometry: Geometry
    values: dict  # the memory model's symbols at this scenario (tokens, world size)
    static: dict[str, int]  # what every schedule holds (weights, gradients, optimizer state, ...)
    gathered: dict[str, int]  # ``static`` and what a step on the whole weights holds besides (FSDP2)
    per_block: bool  # Retain runs per transformer block (the sharding's own gathers; runtime.regional)
    native: Estimate
    update_forward: float  # seconds of one update call's forward
    update_backward: float
    transient: int  # bytes of the activations of one native update call in flight
    saved_seconds: float  # what the update saves per trained step when it does not run its forward
    saved_flops: float
    # What the per-row program adds beyond the roofline, against eager (measured; 0 on a named device): per kept
    # rollout call, its forward's per-operator cost and the engine's checks; per backward of a served call, its
    # per-operator cost in place of the update's forward and backward; per served call, the engine's checks. And
    # its compile amortised over the run's steps (0 where the run's length is unknown).
    kept_extra: float = 0.0
    backward_extra: float = 0.0
    served_extra: float = 0.0
    compile_share: float = 0.0

    def program_seconds(self, steps: float, backwards: int = 1) -> float:
        """What serving ``steps`` trained steps from the per-row program adds to the saved forwards' prediction,
        each served call running ``backwards`` backwards (Reweight: one per provisional cotangent)."""
        if steps <= 0:
            return 0.0
        g = self.geometry
        return (steps * (g.rollout_calls * self.kept_extra
                         + g.window_calls * (backwards * self.backward_extra + self.served_extra))
                + self.compile_share)

    def estimate(self, name, static, extra, seconds, flops, steps=(), note="") -> Estimate:
        return _estimate(name, static, extra, self.budget, seconds, flops, steps, note=note)

    def retained_step_bytes(self, per_block: bool) -> int:
        """What retaining one trained step holds: every row that trains it, whole program or per block."""
        return int((self.geometry.retained_rows * activations_per_row(self.scenario, per_block)).subs(self.values))


Estimator = Callable[[StepModel], Estimate]


def plan(s: Scenario, device: Device, budget: int | None = None, *, estimators: Mapping[Schedule, Estimator],
         overheads: Overheads | None = None, run_steps: int | None = None) -> CostPlan:
    """Predict native and each schedule of ``estimators`` (the registry's, :mod:`leancompile.schedules`), and
    choose per trained step, on ``device`` within ``budget`` bytes (default: the device's free memory less a
    margin). A schedule the scenario refuses (``Scenario.refusals``) is predicted as not fitting, with the reason.

    ``overheads``: the per-operator costs measured on ``device`` (:mod:`leancompile.runtime.calibration`): each
    call's fixed cost is then that of its program, eager or per-row, instead of the device's one launch cost per
    operator, and the per-row program's compile is priced, amortised over ``run_steps`` GRPO steps where given."""
    _, ROWS, TOKENS, _, WORLD = _memory_model()
    budget = int(device.available * MARGIN) if budget is None else int(budget)
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes; got {budget}")
    if run_steps is not None and (not isinstance(run_steps, int) or run_steps < 1):
        raise ValueError(f"run_steps must be a number of GRPO steps >= 1, or None where unknown; got {run_steps!r}")
    g, cfg = _geometry(s), s.config
    values = {TOKENS: s.profile.tokens, WORLD: s.world_size}
    static = {k: int(v.subs(values)) for k, v in static_memory(s).items()}
    peak_flops = device.peak_flops(s.compute_dtype)

    def seconds(work, rows, per_operator=None):  # the roofline, and each operator's fixed cost
        fixed = device.launch if per_operator is None else per_operator
        return work.seconds(peak_flops, device.bandwidth, fixed, rows)

    o, forward, backward = overheads, s.profile.forward, s.profile.backward
    update, rollout = (None, None) if o is None else (o.eager_update, o.eager_forward)
    fwd_u, bwd_u = seconds(forward, g.update_rows, update), seconds(backward, g.update_rows, update)
    fwd_r = seconds(forward, g.rollout_rows, rollout)
    program, compile_seconds = {}, 0.0
    if o is not None:
        compile_seconds = o.compile_seconds(forward.count + backward.count)
        program = dict(kept_extra=forward.count * (o.program_forward - o.eager_forward) + o.call,
                       backward_extra=(forward.count + backward.count) * o.program_backward
                       - backward.count * o.eager_update,
                       served_extra=o.call, compile_share=compile_seconds / run_steps if run_steps else 0.0)
    flops_f, flops_b = s.profile.forward.total_flops, s.profile.backward.total_flops
    ckpt = bool(cfg.gradient_checkpointing)
    kl = cfg.beta > 0
    per_update = fwd_u + bwd_u + ckpt * fwd_u + kl * fwd_u
    optimizer = g.optimizer_steps * 16 * s.trainable_params * s.trainable_bytes / device.bandwidth
    native_s = cfg.num_steps * g.rollout_calls * fwd_r + g.micro_steps * per_update + optimizer
    native_f = (cfg.num_steps * g.rollout_calls * g.rollout_rows * flops_f
                + g.micro_steps * g.update_rows * (flops_f * (1 + kl + ckpt) + flops_b))
    transient = int(call_memory(s, ckpt).subs({ROWS: g.update_rows, **values}))
    native = _estimate(str(Schedule.NATIVE), static, {"activations (one call)": transient}, budget, native_s,
                       native_f, note="the untransformed program")
    # What one eligible step saves when the update does not run its forward (per window call: the forward and,
    # under checkpointing, its recomputation).
    model = StepModel(s, device, budget, g, values, static, {**static, **_gathered(s)},
                      s.layout.sharded and s.world_size > 1, native, fwd_u, bwd_u, transient,
                      g.window_calls * fwd_u * (1 + ckpt), g.window_calls * g.update_rows * flops_f * (1 + ckpt),
                      **program)
    refused = {r.schedule: str(r) for r in (*s.refusals, *s.layout.refused(s.world_size))}
    estimates = tuple(Estimate(str(name), False, 0, (), math.inf, math.inf, note=refused[name]) if name in refused
                      else estimate(model) for name, estimate in estimators.items())
    others = [e for e in estimates if e.schedule != Schedule.RETAIN]
    retain = Schedule.RETAIN not in refused
    auto = _auto(model, others, per_block=model.per_block, retain=retain)
    if model.per_block and s.layout.whole_call and retain:
        # or the partition's checkpoint level on the gathered weights, where that fits and is faster
        whole = _auto(model, others)
        if whole.fits and (not auto.fits or whole.seconds < auto.seconds):
            auto = whole
    if model.per_block and auto.runs is Schedule.RETAIN:
        auto = replace(auto, note=f"{auto.note} ({'per block' if auto.per_block else 'on the gathered weights'})")
    if auto.runs is Schedule.NATIVE and native.fits:
        auto = replace(auto, note="native: " + _not_faster(model, native, [e for e in estimates if e.fits]))
    retain_static = static if model.per_block else model.gathered
    limits = _limits(s, g, sum(retain_static.values()), budget, model.per_block) + _sharding_lines(model)
    reweight = next((e for e in estimates if e.schedule == Schedule.REWEIGHT and e.available), None)
    if reweight is not None:
        whole = _reweight_at(model, 1.0) if reweight.steps and reweight.steps[0].fraction < 1 else reweight
        limits += _reweight_limit(s, whole, budget)  # the boundary of Reweight of every parameter
        if model.per_block and reweight_per_block(cfg):
            limits += _reweight_layouts(s, whole, reweight)
    return CostPlan(device.name, budget, (native, *estimates, auto), limits, o, compile_seconds, run_steps)


def estimate_retain(m: StepModel) -> Estimate:
    """Every trained step keeps its activations. The update recomputes as native does after the first optimizer
    step: the same call in flight. Before it every call is served and none holds activations."""
    held = m.retained_step_bytes(m.per_block)
    eligible = m.geometry.eligible
    return m.estimate(str(Schedule.RETAIN), m.static if m.per_block else m.gathered,
                      {"retained activations": eligible * held,
                       "activations (one call)": m.transient * (m.geometry.optimizer_steps > 1)},
                      m.native.seconds - eligible * m.saved_seconds + m.program_seconds(eligible),
                      m.native.flops - eligible * m.saved_flops,
                      all_steps(Action.RETAIN, eligible), note=f"every trained step keeps {format_bytes(held)}")


def _gathered(s: Scenario) -> dict[str, int]:
    """Under FSDP2 the whole-call partition's mixes (partial retention) run on the whole weights
    (trainers.parallel): every rank holds the rest of the weights and whole gradients until they are
    reduce-scattered. Retain and Reweight per block (runtime.regional) hold what native holds besides their own.
    Other sharded layouts serve per block only."""
    if not s.layout.whole_call or s.world_size == 1:
        return {}
    whole = (s.total_params - s.trainable_params) * s.weight_bytes + 2 * s.trainable_params * s.trainable_bytes
    return {"gathered (FSDP2)": whole - whole // s.world_size}


def _estimate(name, static, extra, budget, seconds, flops, steps=(), runs=None, note="") -> Estimate:
    components = {**static, **{k: int(v) for k, v in extra.items()}}
    peak = sum(components.values())
    return Estimate(name, peak <= budget, peak, tuple(components.items()), float(seconds), float(flops), steps,
                    Schedule(name) if runs is None else runs, note)


def reweight_per_block(config) -> bool:
    """Whether Reweight may run per block under FSDP2: its loss heads run the backbone forward and backward after
    each kept rollout step, through FSDP2's per-block all-gathers, which every rank must run in the same order. So
    every rank must keep the same steps: the first k (ranks draw random and window steps of their own)."""
    return config.trained_steps == "first"


def estimate_reweight(m: StepModel) -> Estimate:
    """Gradient buffers instead of activations: the update's forward and backward move into the rollout, the
    backward once per provisional cotangent. Per block, where every block's buffers do not fit, Reweight of the
    last blocks that fit (``reweight@f``, f the share of the blocks' parameters); the others recompute in the
    update."""
    whole = _reweight_at(m, 1.0)
    if whole.fits or not (m.per_block and reweight_per_block(m.scenario.config)):
        return whole
    empty = _reweight_at(m, 0.0)  # peak(f) is linear in f
    room = (m.budget - empty.peak_bytes) / max(whole.peak_bytes - empty.peak_bytes, 1)
    fraction = math.floor(min(room, 1.0) * 100) / 100
    while fraction >= _SMALLEST_PARTIAL:  # the kept call's activations make it linear only nearly
        estimate = _reweight_at(m, fraction)
        if estimate.fits:
            return estimate
        fraction = round(fraction - 0.01, 2)
    return whole


def _reweight_at(m: StepModel, fraction: float) -> Estimate:
    """Reweight whose per-sample gradients cover ``fraction`` of the parameters (per block: the last blocks'; the
    first recompute in the update, and the heads run their forward again, without grad)."""
    sympy, _, TOKENS, _, _ = _memory_model()
    s, g, cfg = m.scenario, m.geometry, m.scenario.config
    backwards = 1 + s.advantage_free  # one per-row backward per provisional cotangent
    per_block = m.per_block and reweight_per_block(cfg)
    count = s.buffers if s.buffers is not None else g.window_samples * (1 + s.advantage_free)
    # One per-row gradient per buffer, whole (also under FSDP2); a whole call's keeps a linear weight's as its
    # factors where those are smaller (passes.rowwise), the input's side once per row for every cotangent
    p = s.profile
    factored, per_cotangent, per_row_input = (0, 0, 0) if per_block else \
        (p.factored_params, p.factors_per_cotangent, p.factors_per_row)
    buffer = (s.trainable_params - factored) * s.trainable_bytes + per_cotangent * s.compute_dtype.itemsize
    inputs = (count // backwards) * per_row_input * s.compute_dtype.itemsize
    trained = g.window_samples * cfg.num_trained_steps
    segments = 2 if cfg.use_cfg else 1
    kept = 2 * trained * (segments + (cfg.beta > 0)) * s.latent_bytes
    # Per window call: the update's forward and backward move into the rollout, the backward `backwards` times;
    # each (sample, step) adds its gradient into a buffer (read, add, write) and the correction reads them all. Of
    # a partial Reweight's recomputed blocks the heads run the forward once more.
    per_step = g.window_calls * (fraction * (m.update_forward * (1 + cfg.gradient_checkpointing)
                                             + m.update_backward * (1 - backwards))
                                 - (1 - fraction) * m.update_forward)
    traffic = fraction * (3 * trained + 2 * count) * buffer / m.device.bandwidth
    # A KL term's reference forward moves into the rollout's first loss head; the others read its kept velocity.
    flops = m.native.flops - g.eligible * g.window_calls * g.update_rows * (
        fraction * (s.profile.forward.total_flops * (1 + cfg.gradient_checkpointing)
                    + s.profile.backward.total_flops * (1 - backwards))
        - (1 - fraction) * s.profile.forward.total_flops)
    # each buffer's row keeps the cotangent it was made from (one output row), to find its coefficients
    held = {"gradient buffers": int(fraction * (count * buffer + inputs)),
            "provisional cotangents": count * s.latent_bytes, "kept outputs": kept}
    if per_block:  # (runtime.regional): no whole weights; each buffer's row also keeps, at every block, its
        # inputs' gradients (the size of the blocks' inputs, what checkpointing keeps)
        per_row = sympy.Rational(s.profile.checkpoint_bytes, s.profile.tokens) * TOKENS
        held["block input gradients"] = int((fraction * count * per_row).subs(m.values))
    # The kept call's activations live until its provisional backward has made its step's buffers: the peak holds
    # the other steps' buffers and the larger of the two.
    activations = int((fraction * g.rollout_rows * activations_per_row(s, per_block)).subs(m.values))
    step_buffers = sum(v for k, v in held.items() if k != "kept outputs") / g.eligible
    held["activations (kept call)"] = max(0, int(activations - step_buffers))
    if fraction < 1:  # the recomputed blocks' call in flight in the update
        held["activations (one call)"] = int((1 - fraction) * m.transient)
    where = (" (per block: each rank's own samples', whole and unreduced)" if per_block
             else " (on the gathered weights: ranks keep steps of their own)" if m.per_block else "")
    share = (f" for the last {fraction:.0%} of the blocks' parameters, the first blocks recomputing"
             if fraction < 1 else "")
    return m.estimate(str(Schedule.REWEIGHT), m.static if per_block else m.gathered, held,
                      m.native.seconds - g.eligible * per_step + traffic
                      + m.program_seconds(fraction * g.eligible, backwards), flops,
                      tuple(StepAction(i, Action.REWEIGHT, fraction=fraction) for i in range(g.eligible)),
                      note=f"{count} gradient buffers of {format_bytes(fraction * buffer)}{share}{where}")


def _auto(m: StepModel, others: list[Estimate], per_block: bool = False, retain: bool = True) -> Estimate:
    """The best per-step mix of retain / retain@f / offload / recompute, or another schedule's estimate, or
    native. ``per_block`` (FSDP2): each transformer block's own partition (runtime.regional); otherwise the mix
    runs on ``m.gathered``, the weights a whole-call partition runs on.

    A step retained at fraction f holds what the partition saves at activation memory budget f (profiled at
    ``PARTIAL_BUDGETS``; per block, every block's partition at budget f) and saves ``ckpt + f`` update forwards
    (under native checkpointing the update runs its forward twice; the partition recomputes ``1 - f`` of one).
    The best mix raises as many steps as fit to f = 0 where that saves time, then fills whole steps to f = 1
    while they fit, and one step at the largest budget that fits. ``retain=False`` (Retain refused): no mix.
    """
    s, g, native, device = m.scenario, m.geometry, m.native, m.device
    static = m.static if per_block else m.gathered
    step_bytes = m.retained_step_bytes(per_block)
    whole = s.profile.retained_at(1.0, per_block)
    ckpt = bool(s.config.gradient_checkpointing)
    forward_s, forward_f = m.saved_seconds / (1 + ckpt), m.saved_flops / (1 + ckpt)  # one window forward of a step

    def held_at(f: float) -> int:
        return int(step_bytes * s.profile.retained_at(f, per_block) / max(whole, 1))

    low = held_at(0.0) if ckpt else 0
    room = m.budget - sum(static.values()) - m.transient
    offload_s = (1 + ckpt) * forward_s - 2 * step_bytes / device.host_link if device.host_link else -math.inf
    fractions = [None] * g.eligible  # None: recompute
    if ckpt:  # the checkpoint level first, for as many steps as fit: it saves a forward for the fewest bytes
        level = g.eligible if low <= 0 else min(g.eligible, max(0, room) // low)
        fractions[:level] = [0.0] * level
        room -= level * low
    for i in range(g.eligible):
        already = 0 if fractions[i] is None else low
        if step_bytes - already <= room:
            fractions[i], room = 1.0, room - (step_bytes - already)
            continue
        partial = next((f for f in sorted(PARTIAL_BUDGETS, reverse=True)  # the largest profiled budget that fits
                        if 0 < f < 1 and held_at(f) - already <= room), 0.0)
        if partial >= _SMALLEST_PARTIAL:
            fractions[i] = partial
            room = 0
        break
    steps, seconds, flops, held = [], native.seconds, native.flops, 0
    kept_step = m.program_seconds(1) - m.compile_share  # what the per-row program adds to a step it serves
    for f in fractions:
        # Forwards of the step saved: the partition at budget f saves the checkpoint's recomputation and f of the
        # forward.
        share = 0.0 if f is None else ckpt + f
        gain = share * forward_s
        if offload_s > max(gain, kept_step) and (f is None or f < 1):
            steps.append(StepAction(len(steps), Action.OFFLOAD))
            seconds -= offload_s
            flops -= (1 + ckpt) * forward_f
        elif f is None or gain <= kept_step:
            steps.append(StepAction(len(steps), Action.RECOMPUTE))
        else:
            steps.append(StepAction(len(steps), Action.RETAIN, fraction=f))
            seconds -= gain
            flops -= share * forward_f
            held += held_at(f)
    seconds += m.program_seconds(sum(a.kind is not Action.RECOMPUTE for a in steps))
    extra = {"retained activations": held, "activations (one call)": m.transient}
    mix = None
    if retain and any(a.kind is not Action.RECOMPUTE for a in steps):
        mix = replace(_estimate(AUTO, static, extra, m.budget, seconds, flops, tuple(steps), Schedule.RETAIN,
                                note=describe_steps(steps)), per_block=per_block)
    best = min([e for e in (mix, *others) if e is not None and e.fits] + [native], key=lambda e: e.seconds)
    if best is native:
        why = "nothing fits" if not native.fits else "no reuse fits or is faster"
        return replace(native, schedule=AUTO, steps=all_steps(Action.RECOMPUTE, g.eligible), note=f"native: {why}")
    if best is mix:
        return mix
    return replace(best, schedule=AUTO, note=f"{best.schedule}: {best.note}"
                   + ("" if mix is None or not mix.fits else f"; faster than {mix.note}"))


def _not_faster(m: StepModel, native: Estimate, fitting: list[Estimate]) -> str:
    """Why native where it fits, in numbers: each reuse that fits, predicted no faster, and what the per-row
    program adds."""
    if not fitting:
        return "no reuse fits"
    why = (f"no reuse is predicted faster: native {native.seconds:.3g} s a step, "
           + ", ".join(f"{e.schedule} {e.seconds:.3g} s" for e in fitting))
    added = m.program_seconds(m.geometry.eligible)
    if added:
        why += (f"; retaining every trained step saves {m.geometry.eligible * m.saved_seconds:.3g} s of the "
                f"update's forwards, and the per-row program adds {added:.3g} s to it (its cost per operator and "
                "the engine's checks against eager's" + (", and its amortised compile" if m.compile_share else "")
                + ")")
    return why


def describe_steps(steps) -> str:
    """Actions per trained step, counted in order of first use: ``retain x7, retain@0.40 x1, recompute x1``."""
    counts = {}
    for a in steps:
        counts[a.label] = counts.get(a.label, 0) + 1
    return ", ".join(f"{label} x{n}" for label, n in counts.items())


def all_steps(kind: Action, steps: int) -> tuple[StepAction, ...]:
    return tuple(StepAction(i, kind) for i in range(steps))


def _sharding_lines(m: StepModel) -> tuple[tuple[str, str], ...]:
    """Under a sharded layout on several ranks: the weights it gathers per GRPO step, and what Retain per block
    keeps per rank and whether it fits (also where leancompile does not serve the layout: the table says why)."""
    s, g = m.scenario, m.geometry
    layout = s.layout
    if not m.per_block:
        return ()
    # A rollout call gathers every block once; SHARD_GRAD_OP keeps them gathered from one forward to the backward
    rollout = 0 if layout.held_through_backward else s.config.num_steps * g.rollout_calls
    rounds = rollout + g.micro_steps * layout.gathers_per_update
    retain = estimate_retain(m)
    step = m.retained_step_bytes(per_block=True)
    blocks = max(1, s.profile.blocks)
    return ((f"all-gathers per GRPO step ({layout.label})",
             f"every block's weights {rounds:g} times, {format_bytes(rounds * _whole_weights(s))} per rank (the "
             f"rollout's calls {rollout:g}, the update's {g.micro_steps:g} calls {layout.gathers_per_update} each); "
             "the step times do not price the collectives"),
            (f"Retain per block ({layout.label})",
             f"a retained step keeps {format_bytes(step)} per rank ({format_bytes(step // blocks)} a block, no "
             f"weights); every trained step retained: peak {format_bytes(retain.peak_bytes)}, "
             + ("fits" if retain.fits else "does not fit")))


def _limits(s: Scenario, g, base: int, budget: int, per_block: bool) -> tuple[tuple[str, str], ...]:
    """Feasibility boundaries of retaining whole steps, solved from the memory model."""
    sympy, ROWS, TOKENS, STEPS, _ = _memory_model()
    held = g.retained_rows * activations_per_row(s, per_block)
    total = base + call_memory(s, bool(s.config.gradient_checkpointing)).subs(ROWS, g.update_rows) + STEPS * held
    steps = sympy.solve(sympy.Eq(total.subs(TOKENS, s.profile.tokens), budget), STEPS)
    most = int(math.floor(steps[0])) if steps else 0
    tokens = sympy.solve(sympy.Eq(total.subs(STEPS, g.eligible), budget), TOKENS)
    limit = int(math.floor(tokens[0])) if tokens else 0
    return (("retained steps that fit (solved)", f"{max(0, min(most, g.eligible))} of {g.eligible}"
             + (f" (memory allows {most})" if most > g.eligible else "")),
            ("tokens per row at which retaining every trained step fits (solved)",
             f"{max(limit, 0)} (now {s.profile.tokens})"))


def reweight_sample_limit(s: Scenario, reweight: Estimate, budget: int) -> tuple[int, int]:
    """The most samples per optimizer step (per rank) whose Reweight buffers fit in ``budget``, and the bytes each
    sample adds (its gradient buffers and kept outputs; the rest of the peak is taken as fixed, which holds while
    a rollout call's rows do not grow with the samples)."""
    components = dict(reweight.components)
    per_sample = (components["gradient buffers"] + components["kept outputs"]) / s.num_samples
    fixed = reweight.peak_bytes - per_sample * s.num_samples
    return max(0, int(math.floor((budget - fixed) / per_sample))), int(per_sample)


def _reweight_layouts(s: Scenario, whole: Estimate, chosen: Estimate) -> tuple[tuple[str, str], ...]:
    """Under FSDP2, the ways to hold Reweight's per-sample gradients, priced: whole and unreduced on the rank whose
    sample it is; exchanged, so that each rank holds its shard of every rank's samples' gradients (the same bytes
    per rank, 1/W of W times the samples, plus an all-to-all of each buffer); or, where they do not fit, only those
    of the last blocks that fit (``reweight@f``, the first blocks recomputing)."""
    held = dict(whole.components)["gradient buffers"]
    moved = held * (s.world_size - 1) // s.world_size
    fraction = chosen.steps[0].fraction if chosen.steps else 1.0
    part = dict(chosen.components)["gradient buffers"]
    fitting = (f"the last {fraction:.0%} of the blocks' parameters fit: {format_bytes(part)}" if fraction < 1
               else "all fit" if whole.fits else "no share of at least 5% fits")
    keeps = f"kept whole for the last {fraction:.0%}" if fraction < 1 else "kept whole"
    return (("Reweight's per-sample gradients (FSDP2)",
             f"kept whole on their sample's rank: {format_bytes(held)} per rank; exchanged as shards: the same "
             f"{format_bytes(held)} per rank plus an all-to-all of {format_bytes(moved)} per rank and step; "
             f"{fitting}; {keeps}"),)


def _reweight_limit(s: Scenario, reweight: Estimate, budget: int) -> tuple[tuple[str, str], ...]:
    most, per_sample = reweight_sample_limit(s, reweight, budget)
    detail = "" if most else (f": one sample's buffers take {format_bytes(per_sample)}, "
                              f"{format_bytes(reweight.peak_bytes - budget + per_sample * (1 - s.num_samples))} "
                              "beyond the budget")
    return (("samples per step at which Reweight fits (solved)", f"{most} (now {s.num_samples}){detail}"),)
